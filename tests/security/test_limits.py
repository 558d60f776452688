"""Issue 17 §6: limits that hold at scale and under slow, idle or greedy clients."""

from __future__ import annotations

import os
import resource
import socket
import threading

import pytest
import torch

from djinn.errors import DjinnError
from djinn.protocol.frames import VERSION, Kind, encode_frame
from djinn.protocol.tensors import to_wire
from djinn.transport.framing import FrameReader, send_buffers
from tests.conftest import wait_for
from tests.integration.test_malformed import read_frame, request

MIB = 1 << 20


def _raw(app, via: str = "tcp", source: str | None = None) -> socket.socket:
    if via == "unix":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(app.socket_path)
    else:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if source:
            sock.bind((source, 0))
        sock.connect(("127.0.0.1", app.tcp_port))
    sock.settimeout(30)
    return sock


def _session(app, via: str = "tcp") -> socket.socket:
    sock = _raw(app, via)
    body = {"client": "limits", "protocol": VERSION, "token": app.token}
    request(sock, Kind.HELLO, body, rid=1)
    request(sock, Kind.SESSION_OPEN, {"client": "limits"}, rid=2)
    return sock


def test_send_buffers_waits_on_descriptors_above_1024():
    """``select.select`` refused descriptors >= 1024: a big reply on one failed half-way."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 2048:
        pytest.skip("cannot open descriptors above 1024 here")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), hard))
    a, b = socket.socketpair()
    high = os.dup2(a.fileno(), 1500)
    writer = socket.socket(fileno=high)
    a.close()
    writer.setblocking(False)
    payload = os.urandom(8 * MIB)
    got = bytearray()

    def read_all() -> None:
        while len(got) < len(payload):
            got.extend(b.recv(1 << 16))

    reader = threading.Thread(target=read_all)
    reader.start()
    try:
        send_buffers(writer, [payload])
    finally:
        reader.join(30)
        writer.close()
        b.close()
    assert bytes(got) == payload


def test_client_sockets_have_timeouts(appliance):
    """A client waiting for bytes that never come fails instead of hanging forever."""
    with appliance.connect("tcp") as client, client.session() as s:
        assert s.channel.sock.gettimeout() is not None


def test_a_client_not_reading_a_big_reply_does_not_stall_the_worker(fresh_appliance):
    app = fresh_appliance(cpu_workers=1, arena_bytes="128MiB")
    hog = _session(app)
    big = torch.arange(16 * MIB, dtype=torch.float32)  # 64 MiB: far more than socket buffers
    desc, flat = to_wire(big)
    body = {"tensors": [{"desc": desc, "seg": 0}]}
    send_buffers(hog, encode_frame(Kind.PUT, 3, body, [memoryview(flat.numpy())]))
    _, reply, _ = read_frame(hog)
    handle = reply["handles"][0]
    send_buffers(hog, encode_frame(Kind.GET, 4, {"handles": [handle]}))  # ... and never read
    # Meanwhile another session works normally, many round trips.
    with app.connect("unix") as client, client.session() as s:
        for k in range(20):
            t = torch.full((1000,), float(k))
            assert torch.equal(s.put(t).cpu(), t)
        # the hog's reply is still waiting for it, intact
    reader = FrameReader(hog, authenticated=True)
    frame = None
    while frame is None:
        frame = reader.poll()
    assert frame.kind is Kind.REPLY and frame.request_id == 4
    back = torch.frombuffer(frame.segments[0], dtype=torch.float32)
    assert torch.equal(back, big)
    hog.close()


def test_idle_unauthenticated_flood_does_not_lock_out_a_client_with_the_token(fresh_appliance):
    app = fresh_appliance(cpu_workers=1)
    idle = []
    try:
        for i in range(300):  # more than the global pre-auth cap, from another address
            try:
                idle.append(_raw(app, source=f"127.0.0.{2 + i % 2}"))
            except OSError:
                break
        for _ in range(3):
            with app.connect("tcp") as client, client.session() as s:
                assert torch.equal(s.put(torch.ones(4)).cpu(), torch.ones(4))
        # and from the flooder's own address too: the newest connection gets its chance
        more = [_raw(app, source="127.0.0.2") for _ in range(40)]
        idle.extend(more)
        with app.connect("tcp") as client:
            assert "workers" in client.stats()
    finally:
        for sock in idle:
            sock.close()


def test_fifteen_hundred_sessions_keep_the_worker_alive(fresh_appliance):
    """Their stats rows no longer fit one control datagram (~212 KB: EMSGSIZE stopped the
    worker at about 1,000 sessions)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 4096:
        pytest.skip("needs more descriptors than this machine allows")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 4096), hard))
    app = fresh_appliance(cpu_workers=1, heartbeat_interval=60.0)
    socks = []
    try:
        for _ in range(1500):
            socks.append(_session(app, "unix"))
        stats = wait_for(lambda: (st := app.stats()) and len(st["sessions"]) >= 1500 and st)
        assert stats["workers"][0]["alive"] and stats["workers"][0]["restarts"] == 0
        request(socks[0], Kind.HEARTBEAT, {}, rid=9)  # the first session still works
        with app.connect("unix") as client, client.session() as s:
            assert torch.equal(s.put(torch.ones(3)).cpu(), torch.ones(3))
    finally:
        for sock in socks:
            sock.close()


def test_inline_frame_buffers_are_charged(fresh_appliance):
    """Partial inline frames made the worker hold private memory nobody counted."""
    # one device budget (Note [one device budget]): 64 MiB holds one 40 MiB frame, not two
    app = fresh_appliance(cpu_workers=1, cpu_worker_memory="64MiB")
    first, second = _session(app), _session(app)
    body = {"nodes": [], "keep": [], "fetch": []}
    head = encode_frame(Kind.EXEC, 5, body, [b"\0" * (40 * MIB)])
    first.sendall(head[0])
    first.sendall(b"\0" * MIB)  # ... and the remaining 39 MiB never come
    wait_for(lambda: app.stats()["vmu"]["devices"][0]["stack"]["used"] >= 40 * MIB)
    send_buffers(second, encode_frame(Kind.EXEC, 6, body, [b"\0" * (40 * MIB)]))
    got, reply, _ = read_frame(second)
    assert got.kind is Kind.ERROR and reply["code"] == "RESOURCE_EXHAUSTED", reply
    first.close()
    wait_for(lambda: app.stats()["vmu"]["devices"][0]["stack"]["used"] == 0)
    second.close()


def test_register_refuses_a_config_bigger_than_its_weights(appliance):
    """A 291-byte REGISTER of GPT-2 with n_layer=3000 and no weights built for 17 s."""
    import orjson

    from djinn.protocol.fingerprint import model_fingerprint

    config = {"model_type": "gpt2", "n_layer": 3000, "n_embd": 64, "n_head": 2}
    config_json = orjson.dumps(config).decode()
    cls = "transformers.models.gpt2.modeling_gpt2.GPT2Model"
    fp = model_fingerprint(cls, config_json, [])
    with appliance.connect("unix") as client, client.session() as s:
        with pytest.raises(DjinnError) as info:
            body = {"fingerprint": fp, "class": cls, "config_json": config_json, "state": {}}
            s._call(Kind.REGISTER, body)
        assert info.value.code == "INVALID_ARGUMENT"
        assert "n_layer" in info.value.message
