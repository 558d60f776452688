"""Listening sockets and who may talk to the appliance.

- Unix socket: created mode 0600; every peer's credentials (SO_PEERCRED) are checked and
  only the appliance's own user (or root) is accepted. No token needed.
- TCP: binds 127.0.0.1 unless configured; a peer must present the token in HELLO,
  compared in constant time.
"""

from __future__ import annotations

import contextlib
import hmac
import os
import re
import secrets
import socket
import struct
from pathlib import Path

from djinn.errors import ConfigError

_CRED = struct.Struct("3i")


def unix_listener(path: str) -> socket.socket:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    if p.exists() or p.is_symlink():
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(p))
        except OSError:
            p.unlink()  # stale socket from an appliance that died
        else:
            raise ConfigError(f"an appliance is already listening on {p}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(str(p))
    finally:
        os.umask(old)
    os.chmod(p, 0o600)
    sock.listen(128)
    sock.setblocking(False)
    return sock


def tcp_listener(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on tcp://{host}:{port}: {exc.strerror}") from None
    sock.listen(128)
    sock.setblocking(False)
    return sock


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of a Unix-socket peer."""
    return _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))


def unix_peer_allowed(uid: int) -> bool:
    return uid == os.getuid() or uid == 0


def token_matches(expected: str, offered: object) -> bool:
    if not expected or not isinstance(offered, str):
        return False
    return hmac.compare_digest(expected.encode(), offered.encode())


TENANT_NAME = re.compile(r"[A-Za-z0-9_.-]{1,32}")
MIN_TENANT_TOKEN = 16


def load_tenant_tokens(path: str) -> dict[str, str]:
    """Tenants' own TCP tokens (setting tenant_tokens_file): ``name token`` per line,
    ``#`` comments. A client presenting one is tenant ``token:NAME`` for fair shares
    (scheduler_weights). Returns {name: token}; a malformed file is a ConfigError that
    names the line (never the token)."""
    if not path:
        return {}
    file = Path(path).expanduser()
    try:
        text = file.read_text()
    except OSError as exc:
        raise ConfigError(f"tenant_tokens_file {file}: {exc.strerror}") from None
    tokens: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2 or not TENANT_NAME.fullmatch(parts[0]):
            raise ConfigError(f"tenant_tokens_file {file}:{n}: expected 'name token'")
        if len(parts[1]) < MIN_TENANT_TOKEN:
            raise ConfigError(
                f"tenant_tokens_file {file}:{n}: the token of {parts[0]!r} is shorter than "
                f"{MIN_TENANT_TOKEN} characters"
            )
        if parts[0] in tokens or parts[1] in tokens.values():
            raise ConfigError(f"tenant_tokens_file {file}:{n}: {parts[0]!r} or its token repeats")
        tokens[parts[0]] = parts[1]
    return tokens


def tenant_of_token(tokens: dict[str, str], offered: object) -> str | None:
    """The tenant whose token was offered, comparing with every one in constant time."""
    found = None
    for name, token in tokens.items():
        if token_matches(token, offered):
            found = name
    return found


def ensure_token(token: str, token_file: str) -> str:
    """The configured token, else the token file's, else a new one written there (0600)."""
    if token:
        return token
    if not token_file:
        raise ConfigError("TCP needs a token: set token, DJINN_TOKEN or token_file")
    path = Path(token_file)
    if path.is_file():
        value = path.read_text().strip()
        if value:
            return value
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    value = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    return value


def set_nodelay(sock: socket.socket) -> None:
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
