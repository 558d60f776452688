"""A client's connection to the appliance: one blocking socket, requests answered in order.

Requests are serialised by a lock (the heartbeat thread shares the session's channel);
the lock covers only the socket exchange, so copying a large reply out of the arena never
holds up a heartbeat.

Note [interrupted waits]: a program interrupted while it sends a request or waits for a
reply (Ctrl-C: a KeyboardInterrupt raised there) closes the connection. The stream may
hold part of a frame, either way (a review's SIGINT during a 32 MiB reply lost the bytes
``recv_into`` had just taken), and the reply still on its way would be read as the next
request's: "reply to request 7, expected 8", as it was until 2026-11-28. So the next call
finds the connection gone, as after a lost worker: a recovering session (the default) is
rebuilt from its journal, the worker frees the old one, and a graph in flight is sent
again (Note [lineage journal]); with recovery off, its tensors raise SESSION_LOST. Where
the program waits for a graph's result, the frontend holds the first Ctrl-C until the
graph landed, so that this is rare (djinn/frontend/interrupts.py).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import select
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from djinn.errors import DjinnError, ProtocolError, UnsupportedOp, error_from_wire
from djinn.protocol.frames import HEADER_SIZE, VERSION, Frame, Kind, encode_frame
from djinn.transport.address import Address
from djinn.transport.framing import FrameReader, PeerClosed, Sink, default_sink, send_buffers
from djinn.transport.spin import Spin

CLIENT_NAME = "djinn-python"

# Note [a forked process]: a process forked from one holding a connection (a DataLoader
# worker, forked by default on Linux) holds the same socket. A request from it was read by
# the appliance as the parent's, and the replies went to whichever read first: "reply to
# request 4, expected 6", a lost session, then a hang (a review: a default device of
# "cuda" makes the collate function's tensors remote in the workers). As CUDA refuses a
# forked child the parent's context, every connection the parent held is refused in the
# child, typed, before its lock is taken (another thread may have held it at the fork)
# and before anything is sent; the child may open connections of its own.
FORKED = (
    "this process was forked from one that holds a connection to the appliance (a "
    "DataLoader worker, say), and cannot use that connection, as a forked process "
    "cannot use its parent's CUDA context: make tensors on the CPU in such a process "
    "(a default device of 'cuda' makes them remote), or start it with "
    "multiprocessing_context='spawn'"
)
_channels: weakref.WeakSet[Channel] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for channel in list(_channels):
        channel.forked = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class Channel:
    def __init__(
        self, address: Address, on_lost: Callable[[str], DjinnError], spin_us: float = 0.0
    ) -> None:
        self.address = address
        self.sock = address.open()
        self.reader = FrameReader(self.sock, authenticated=True)
        self.spin = Spin(spin_us)  # Note [spin before sleeping] (djinn/transport/spin.py)
        # used under the lock only: a poll object refuses a second poll() while one runs
        # (the heartbeat thread asks reply_waiting without the lock, with its own)
        self._poller = select.poll()
        self._poller.register(self.sock, select.POLLIN)
        self.lock = threading.Lock()
        self._ids = itertools.count(1)
        self._on_lost = on_lost
        self.closed = False
        self.forked = False  # Note [a forked process]
        _channels.add(self)
        self._awaiting: list[tuple[int, Kind, Sink | None]] = []  # sent, reply not read
        self._stash: dict[int, Frame | DjinnError] = {}  # read, not yet asked for
        self.bytes_sent = 0  # on the socket, both directions: what a call costs on the wire
        self.bytes_received = 0
        # The same bytes by the kind of request they belong to: the heartbeat thread shares
        # this channel, so what one call costs is the totals less what heartbeats took.
        self.sent_by_kind: Counter[Kind] = Counter()
        self.received_by_kind: Counter[Kind] = Counter()

    def hello(self, token: str | None) -> dict[str, Any]:
        body = {"client": CLIENT_NAME, "protocol": VERSION, "pid": os.getpid()}
        if token:
            body["token"] = token
        return self.call(Kind.HELLO, body).body

    def call(
        self,
        kind: Kind,
        body: dict[str, Any] | None = None,
        segments: Sequence[Any] = (),
        *,
        sink: Sink | None = None,
        first: bool = False,
    ) -> Frame:
        """Send a request and wait for its reply. The replies of requests sent without
        waiting are read (and kept for ``receive``) before it is sent, or with ``first``
        after: only for a small request behind small replies (Note [puts sent without
        waiting]), since a worker reads nothing more of a session whose reply it cannot
        write."""
        sent = False
        self._not_forked()
        with self.lock:
            try:
                if not first:
                    self._drain()
                rid = self._send(kind, body, segments)
                sent = True
                if first:
                    self._drain()
                return self._receive(kind, rid, sink)
            except BaseException as exc:
                self._cut_short(exc, sent)
                raise

    def send(
        self,
        kind: Kind,
        body: dict[str, Any],
        segments: Sequence[Any] = (),
        sink: Sink | None = None,
    ) -> int:
        """Send a request without waiting for its reply (Note [asynchronous flushes] in
        djinn/frontend/inflight.py); its id, for ``receive``. Replies come in the order of
        the requests: a ``call`` made meanwhile reads this one's first and keeps it."""
        self._not_forked()
        with self.lock:
            rid = self._send(kind, body, segments)
            self._awaiting.append((rid, kind, sink))
            return rid

    def _not_forked(self) -> None:
        if self.forked:  # Note [a forked process]
            raise UnsupportedOp(FORKED)

    def reply_waiting(self) -> bool:
        """Whether bytes of a reply wait on the connection (never blocks)."""
        if self.reader.buffered():
            return True
        try:
            poller = select.poll()
            poller.register(self.sock, select.POLLIN)
            return bool(poller.poll(0))
        except (OSError, ValueError):  # closed under us: the next request says so
            return False

    def _readable(self) -> bool:
        """``reply_waiting`` for the thread holding the lock, with the channel's poller."""
        return bool(self.reader.buffered() or self._poller.poll(0))

    def receive(self, rid: int) -> Frame:
        """The reply to ``send``'s request ``rid`` (its error raised)."""
        self._not_forked()
        with self.lock:
            try:
                self._drain(until=rid)
            except BaseException as exc:
                self._cut_short(exc, False)
                raise
            got = self._stash.pop(rid, None)
        if got is None and self.closed:  # an interrupted read closed it: Note [interrupted waits]
            raise self._on_lost("connection already closed")
        if got is None:
            raise ProtocolError(f"no reply awaited for request {rid}")
        if isinstance(got, DjinnError):
            raise got
        return got

    def _drain(self, until: int | None = None) -> None:
        """Read the replies of requests sent without waiting (all, or up to ``until``)."""
        while self._awaiting:
            rid, kind, sink = self._awaiting.pop(0)
            try:
                self._stash[rid] = self._receive(kind, rid, sink)
            except DjinnError as exc:
                self._stash[rid] = exc
            if rid == until:
                return

    def _send(self, kind: Kind, body: dict[str, Any] | None, segments: Sequence[Any]) -> int:
        if self.closed:
            raise self._on_lost("connection already closed")
        rid = next(self._ids)
        try:
            buffers = encode_frame(kind, rid, body, list(segments))
        except ProtocolError:
            self.close()
            raise
        sent = sum(memoryview(b).nbytes for b in buffers)
        self.bytes_sent += sent
        self.sent_by_kind[kind] += sent
        try:
            send_buffers(self.sock, buffers)
        except (PeerClosed, OSError) as exc:
            self.close()
            raise self._on_lost(str(exc)) from None
        except BaseException:  # part of a frame may have gone: Note [interrupted waits]
            self.close()
            raise
        return rid

    def _receive(self, kind: Kind, rid: int, sink: Sink | None) -> Frame:
        if self.closed:
            raise self._on_lost("connection already closed")
        try:
            self.reader.sink = sink or default_sink
            if self.spin.window and not self.reader.buffered():
                self._await_reply(kind)
            frame = None
            while frame is None:
                frame = self.reader.poll()
        except (PeerClosed, OSError) as exc:
            self.close()
            raise self._on_lost(str(exc)) from None
        except ProtocolError:
            self.close()
            raise
        h = frame.header
        received = HEADER_SIZE + h.body_len + h.payload_len
        self.bytes_received += received
        self.received_by_kind[kind] += received
        # an error about no request in particular (0: the connection is refused) ends it;
        # any other answer to another request means the two ends lost count
        if frame.request_id != rid and not (frame.kind == Kind.ERROR and frame.request_id == 0):
            self.close()
            raise ProtocolError(f"reply to request {frame.request_id}, expected {rid}")
        if frame.kind == Kind.ERROR:
            raise error_from_wire(str(frame.body.get("code")), str(frame.body.get("message")))
        return frame

    def _await_reply(self, kind: Kind) -> None:
        """Until the reply's first bytes are here: polling a moment, then sleeping (Note
        [spin before sleeping]). How long it took decides whether the next such wait
        polls. A reply already here (a flight's, read later) says nothing of that."""
        if self._readable():
            return
        t0 = time.perf_counter()
        if not self.spin.poll(self._readable, kind):
            timeout = self.sock.gettimeout()  # Note [client timeouts]
            if not self._poller.poll(None if timeout is None else timeout * 1000):
                raise TimeoutError(f"no reply for {timeout:g} s")
            # readable, or closed: the read says which
        self.spin.waited(time.perf_counter() - t0, kind)

    def _cut_short(self, exc: BaseException, sent: bool) -> None:
        """An exchange that raised ``exc`` (under the lock). Note [interrupted waits]: a
        KeyboardInterrupt leaves the stream unknown, and closes it (an Exception is the
        channel's own, or a bug's). Whether the request went goes with any exception but
        the channel's own, for ``Session._call``'s frees."""
        if not isinstance(exc, Exception):
            self.close()
        if not isinstance(exc, DjinnError):
            exc.djinn_sent = sent  # type: ignore[attr-defined]

    def call_bytes(self) -> int:
        """Bytes both ways on this channel so far, heartbeats left out."""
        beats = self.sent_by_kind[Kind.HEARTBEAT] + self.received_by_kind[Kind.HEARTBEAT]
        return self.bytes_sent + self.bytes_received - beats

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            with contextlib.suppress(OSError):
                self.sock.close()
