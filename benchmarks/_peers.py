"""Raw-socket ceilings for the transport benchmark: a peer process (no torch) that echoes
64-byte pings and sinks one-way streams, over a Unix socketpair or TCP loopback.

The peer is this file run as a script (``python benchmarks/_peers.py --peer unix FD`` or
``--peer tcp PORT``); ``python benchmarks/transport.py --peer ...`` does the same.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from _common import TRANSPORTS, MiB, clock

PING_BYTES = 64
_CMD = struct.Struct("<cQ")  # command, argument
SINK_RING = 64 * MiB  # the peer's receive buffer: warm, reused, at most this big


def recv_exact(sock: socket.socket, view: memoryview, polling: bool = False) -> None:
    """Fill ``view`` from ``sock``: blocking, or (``polling``) retrying a non-blocking
    recv until the bytes are there, never sleeping."""
    got = 0
    flags = socket.MSG_DONTWAIT if polling else 0
    while got < len(view):
        try:
            n = sock.recv_into(view[got:], len(view) - got, flags)
        except BlockingIOError:
            continue
        if n == 0:
            raise EOFError("peer closed the connection")
        got += n


# -- the peer process ---------------------------------------------------------------------------
def peer_main(transport: str, where: str) -> int:
    """Serve the parent's commands on one socket until it closes.

    ``P n``: echo n messages of PING_BYTES, blocking recv. ``E n``: the same through an
    epoll selector on a non-blocking socket, as a server that multiplexes many sessions
    (the appliance's worker) must wait for them. ``B n``: the same, polling a
    non-blocking recv without ever sleeping (the floor for two ends that poll, Note [spin
    before sleeping] in djinn/transport/spin.py). ``S n``: receive n bytes with
    ``recv_into`` (into one warm buffer of min(n, SINK_RING) bytes, reused round-robin, so
    a 1 GiB stream does not cost the peer 1 GiB of memory), then ack one byte.
    """
    if transport == "unix":
        sock = socket.socket(fileno=int(where))
    else:
        sock = socket.create_connection(("127.0.0.1", int(where)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    head = memoryview(bytearray(_CMD.size))
    ping = memoryview(bytearray(PING_BYTES))
    ring = memoryview(bytearray())
    try:
        while True:
            recv_exact(sock, head)
            cmd, arg = _CMD.unpack(head)
            if cmd == b"P":
                for _ in range(arg):
                    recv_exact(sock, ping)
                    sock.sendall(ping)
            elif cmd == b"E":
                _echo_selected(sock, ping, arg)
            elif cmd == b"B":
                for _ in range(arg):
                    recv_exact(sock, ping, polling=True)
                    sock.sendall(ping)
            elif cmd == b"S":
                if len(ring) < min(arg, SINK_RING):
                    ring.release()
                    ring = memoryview(bytearray(min(arg, SINK_RING)))
                left = arg
                while left:
                    chunk = min(left, len(ring))
                    recv_exact(sock, ring[:chunk])
                    left -= chunk
                sock.sendall(b"k")
    except (EOFError, ConnectionError):
        return 0
    finally:
        sock.close()


def _echo_selected(sock: socket.socket, ping: memoryview, n: int) -> None:
    sel = selectors.DefaultSelector()
    sock.setblocking(False)
    sel.register(sock, selectors.EVENT_READ)
    try:
        for _ in range(n):
            got = 0
            while got < len(ping):
                sel.select()
                k = sock.recv_into(ping[got:])
                if k == 0:
                    raise EOFError("peer closed the connection")
                got += k
            sock.sendmsg([ping])  # a 64-byte reply fits the socket buffer: no partial send
    finally:
        sel.close()
        sock.setblocking(True)


def peer_argv(argv: list[str]) -> tuple[str, str] | None:
    """``(transport, where)`` when ``argv`` is ``--peer TRANSPORT WHERE``, else None."""
    if len(argv) == 3 and argv[0] == "--peer":
        return argv[1], argv[2]
    return None


# -- the parent's end ---------------------------------------------------------------------------
class Peer:
    """The parent's end of a raw-socket peer process (Unix socketpair or TCP loopback)."""

    def __init__(self, transport: str) -> None:
        self.transport = transport
        argv = [sys.executable, str(Path(__file__).resolve()), "--peer", transport]
        if transport == "unix":
            self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            with theirs:
                self.proc = subprocess.Popen(
                    [*argv, str(theirs.fileno())],
                    pass_fds=(theirs.fileno(),),
                    stdin=subprocess.DEVNULL,
                )
        else:
            with socket.create_server(("127.0.0.1", 0)) as listener:
                port = listener.getsockname()[1]
                self.proc = subprocess.Popen([*argv, str(port)], stdin=subprocess.DEVNULL)
                listener.settimeout(30)
                self.sock, _ = listener.accept()
            self.sock.settimeout(None)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._ack = memoryview(bytearray(1))

    def ping_pong(
        self, iterations: int, warmup: int, selected: bool = False, polling: bool = False
    ) -> list[int]:
        """Round trips of PING_BYTES, the peer blocking in recv or, ``selected``, waiting
        in an epoll selector first; ``polling``: both ends poll and never sleep."""
        msg = memoryview(bytes(range(PING_BYTES)))
        back = memoryview(bytearray(PING_BYTES))
        cmd = b"B" if polling else b"E" if selected else b"P"
        self.sock.sendall(_CMD.pack(cmd, warmup + iterations))
        samples: list[int] = []
        for i in range(warmup + iterations):
            t0 = clock()
            self.sock.sendall(msg)
            recv_exact(self.sock, back, polling)
            t1 = clock()
            if i >= warmup:
                samples.append(t1 - t0)
        return samples

    def stream(self, data: memoryview) -> float:
        """Seconds to push ``data`` to the peer until it has received every byte."""
        self.sock.sendall(_CMD.pack(b"S", data.nbytes))
        t0 = clock()
        self.sock.sendall(data)
        recv_exact(self.sock, self._ack)
        return (clock() - t0) / 1e9

    def close(self) -> None:
        self.sock.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@contextlib.contextmanager
def peers() -> Iterator[dict[str, Peer]]:
    started: dict[str, Peer] = {}
    try:
        for transport in TRANSPORTS:
            started[transport] = Peer(transport)
        yield started
    finally:
        for peer in started.values():
            peer.close()


if __name__ == "__main__":
    parsed = peer_argv(sys.argv[1:])
    if parsed is None:
        sys.exit("usage: _peers.py --peer {unix FD | tcp PORT}")
    sys.exit(peer_main(*parsed))
