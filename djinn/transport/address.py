"""Appliance addresses: ``unix:///path/to.sock`` and ``tcp://host:port``."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

from djinn.errors import ConfigError, Unavailable
from djinn.transport.framing import BUFFER_SIZE

CONNECT_TIMEOUT_S = 10.0
# Note [client timeouts]: a client socket never blocks forever. A reply that has not
# progressed for this long (no byte arrived, or none could be sent) means the appliance
# or the path to it is gone, and the call fails with WORKER_LOST instead of hanging. It
# is long because one request may legitimately run for minutes on a busy worker.
IO_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Address:
    scheme: str  # "unix" | "tcp"
    path: str = ""
    host: str = ""
    port: int = 0

    @property
    def is_unix(self) -> bool:
        return self.scheme == "unix"

    def __str__(self) -> str:
        return f"unix://{self.path}" if self.is_unix else f"tcp://{self.host}:{self.port}"

    def open(self, io_timeout: float = IO_TIMEOUT_S) -> socket.socket:
        """A connected, blocking socket (TCP_NODELAY on) whose reads and writes give up
        after ``io_timeout`` seconds without progress (Note [client timeouts])."""
        try:
            if self.is_unix:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(CONNECT_TIMEOUT_S)
                sock.connect(self.path)
            else:
                sock = socket.create_connection((self.host, self.port), CONNECT_TIMEOUT_S)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                    sock.setsockopt(socket.SOL_SOCKET, opt, 4 * BUFFER_SIZE)
        except OSError as exc:
            raise Unavailable(f"cannot reach the appliance at {self}: {exc}") from None
        sock.settimeout(io_timeout)
        return sock


def parse_address(text: str) -> Address:
    parts = urlsplit(text)
    if parts.scheme == "unix":
        path = parts.netloc + parts.path
        if not path:
            raise ConfigError(f"{text!r}: a unix address needs a path (unix:///tmp/djinn.sock)")
        return Address("unix", path=path)
    if parts.scheme == "tcp":
        try:
            port = parts.port
        except ValueError as exc:  # urlsplit: not a number, or out of range
            raise ConfigError(f"{text!r}: {exc} (tcp://host:7711)") from None
        if not parts.hostname or port is None:
            raise ConfigError(f"{text!r}: a tcp address needs host and port (tcp://host:7711)")
        return Address("tcp", host=parts.hostname, port=port)
    raise ConfigError(f"{text!r}: address must start with unix:// or tcp://")
