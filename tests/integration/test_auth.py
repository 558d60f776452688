"""TCP needs the token; the Unix socket is private to the appliance's user."""

from __future__ import annotations

import os
import socket
import stat
import time

import pytest

import djinn
from djinn.errors import AuthFailed
from djinn.protocol.frames import (
    HEADER_SIZE,
    Kind,
    decode_body,
    decode_header,
    encode_body,
    encode_header,
)
from tests.conftest import wait_for


def _raw_hello(port: int, body: dict) -> tuple[dict, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        raw = encode_body(body)
        sock.sendall(encode_header(Kind.HELLO, 1, len(raw)) + raw)
        head = sock.recv(HEADER_SIZE, socket.MSG_WAITALL)
        h = decode_header(head, authenticated=True)
        reply = decode_body(sock.recv(h.body_len, socket.MSG_WAITALL))
        rest = sock.recv(16)  # the appliance closes after a failed HELLO
        return {"kind": h.kind, **reply}, rest


@pytest.mark.parametrize("token", [None, "wrong", "", 12345])
def test_wrong_or_missing_token_gets_auth_failed_and_the_connection_closes(appliance, token):
    body = {"client": "test"} if token is None else {"client": "test", "token": token}
    reply, rest = _raw_hello(appliance.tcp_port, body)
    assert reply["kind"] == Kind.ERROR and reply["code"] == "AUTH_FAILED"
    assert rest == b""


def test_client_with_wrong_token_raises_auth_failed(appliance):
    with pytest.raises(AuthFailed):
        djinn.connect(appliance.tcp, token="nope")
    with pytest.raises(AuthFailed):
        djinn.connect(appliance.tcp, token="")


def test_right_token_is_accepted(appliance):
    with djinn.connect(appliance.tcp, token=appliance.token) as c:
        assert c.stats()["workers"]


def test_unix_socket_is_owner_only(appliance):
    mode = stat.S_IMODE(os.stat(appliance.socket_path).st_mode)
    assert mode == 0o600


def test_unix_peer_of_another_uid_is_refused(fresh_appliance):
    if os.getuid() != 0:
        pytest.skip("needs root to act as another user")
    import shutil
    import tempfile

    where = tempfile.mkdtemp(prefix="djinn-uid-test-")
    os.chmod(where, 0o711)
    appliance = fresh_appliance(socket_path=f"{where}/djinn.sock", tcp_enabled=False)
    os.chmod(appliance.socket_path, 0o666)  # let the other user reach the credential check
    r, w = os.pipe()
    try:
        pid = os.fork()
        if pid == 0:  # child: become nobody, then connect as that user
            code = "NO_REPLY"
            try:
                os.setuid(65534)
                s = socket.socket(socket.AF_UNIX)
                s.settimeout(5)
                s.connect(appliance.socket_path)
                h = decode_header(s.recv(HEADER_SIZE, socket.MSG_WAITALL), authenticated=True)
                code = decode_body(s.recv(h.body_len, socket.MSG_WAITALL))["code"]
            except BaseException as exc:
                code = f"{type(exc).__name__}: {exc}"
            os.write(w, code.encode())
            os._exit(0)
        os.close(w)
        os.waitpid(pid, 0)
        got = os.read(r, 200).decode()
    finally:
        appliance.stop()
        shutil.rmtree(where, ignore_errors=True)
    assert got == "AUTH_FAILED"


def test_tcp_binds_loopback_by_default(appliance):
    assert "tcp=127.0.0.1:" in appliance.readiness


def test_a_flood_of_silent_connections_does_not_stop_the_appliance(fresh_appliance):
    app = fresh_appliance()
    socks = []
    try:
        for _ in range(400):  # more than MAX_PREAUTH_CONNECTIONS, none says HELLO
            s = socket.create_connection(("127.0.0.1", app.tcp_port), timeout=5)
            socks.append(s)
        with djinn.connect(app.unix) as c:  # a real client still gets through
            assert c.stats()["workers"][0]["alive"]
        import select

        # the ones over the cap are closed as soon as they are accepted
        refused: set[int] = set()
        deadline = time.monotonic() + 8.0
        while len(refused) < 400 - 256 and time.monotonic() < deadline:
            readable, _, _ = select.select(
                [s for s in socks if s.fileno() not in refused], [], [], 0.5
            )
            refused |= {s.fileno() for s in readable if s.recv(1) == b""}
        assert len(refused) >= 400 - 256
    finally:
        for s in socks:
            s.close()
    assert app.proc.poll() is None


def test_a_tenant_token_lets_a_tcp_client_in_as_that_tenant(fresh_appliance, tmp_path):
    """tenant_tokens_file: each team its own token, and its sessions are its tenant for
    fair shares (issue 10 §3: weights between tokens)."""
    tokens = tmp_path / "tenants"
    tokens.write_text("# name token\nalice " + "a" * 24 + "\nbob " + "b" * 24 + "\n")
    app = fresh_appliance(tenant_tokens_file=str(tokens), scheduler_weights="token:alice=3")

    def tenant(client, sid):  # once the worker has reported the session
        row = next(r for r in client.stats()["sessions"] if r["id"] == sid)
        return row["state"] == "open" and row["tenant"]

    with djinn.connect(app.tcp, token="a" * 24) as alice, alice.session() as s:
        assert wait_for(lambda: tenant(alice, s.id)) == "token:alice"
    with djinn.connect(app.tcp, token=app.token) as anyone, anyone.session() as s:
        assert wait_for(lambda: tenant(anyone, s.id)).startswith("host:")  # the main token
    with pytest.raises(AuthFailed):
        djinn.connect(app.tcp, token="a" * 23)  # no prefix of a tenant's token


def test_a_malformed_tenant_tokens_file_is_refused_at_start(tmp_path):
    from djinn.appliance.listeners import load_tenant_tokens
    from djinn.errors import ConfigError

    path = tmp_path / "tenants"
    for text, why in [
        ("alice short\n", "shorter than 16"),
        ("alice " + "a" * 20 + " extra\n", ":1: expected"),
        ("al/ice " + "a" * 20 + "\n", "expected"),
        ("a " + "x" * 20 + "\nb " + "x" * 20 + "\n", ":2: .* repeats"),
    ]:
        path.write_text(text)
        with pytest.raises(ConfigError, match=why):
            load_tenant_tokens(str(path))
    with pytest.raises(ConfigError, match="No such file"):
        load_tenant_tokens(str(tmp_path / "missing"))
    path.write_text("# teams\n\nalice " + "a" * 20 + "\n")
    assert load_tenant_tokens(str(path)) == {"alice": "a" * 20}
