"""The supervisor <-> worker control channel.

A ``SOCK_SEQPACKET`` socketpair: every message is one orjson object in one datagram, so
no framing code is needed, and a session's client socket can ride along as an
``SCM_RIGHTS`` file descriptor when the supervisor hands that session to a worker.
End-of-file on the channel is how each side learns that the other died.
"""

from __future__ import annotations

import socket
from typing import Any

import orjson

MAX_CONTROL_MESSAGE = 4 << 20
# a worker's exit status when its device's context is lost (Note [a lost GPU context],
# executor/device.py): the supervisor names the cause when it restarts the worker
DEVICE_LOST_EXIT = 75


def pair() -> tuple[socket.socket, socket.socket]:
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


def send(sock: socket.socket, msg: dict[str, Any], fds: list[int] | None = None) -> None:
    data = orjson.dumps(msg)
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.sendall(data)


def recv(sock: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """One message and any fds it carried; None at end-of-file."""
    data, fds, _flags, _addr = socket.recv_fds(sock, MAX_CONTROL_MESSAGE, 4)
    if not data:
        for fd in fds:
            socket.close(fd)
        return None
    return orjson.loads(data), list(fds)
