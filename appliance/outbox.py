"""A session's pending reply bytes: non-blocking writes the selector loop continues.

Note [slow readers]: the worker serves every session from one thread. A reply written
with a blocking send would hold that thread for as long as the client takes to read it:
a client that stops reading a 200 MB GET would stall every other session on the worker.
So a reply is written as far as the socket takes it *now*; the rest waits here, the
session's socket is watched for writability, and the loop continues the write when the
kernel has room. Meanwhile no further request is read from that session (its replies
must go out in order, and a client that does not read must not make the worker queue
more for it), and a session whose reply makes no progress for ``STALL_S`` is ended.

The buffers are views of the reply's memory (frame header and body bytes, a tensor's
bytes): nothing is copied to queue it.
"""

from __future__ import annotations

import socket
import time
from collections import deque
from collections.abc import Sequence

STALL_S = 30.0  # a reader that takes nothing for this long has gone away
MAX_IOV = 512  # buffers per sendmsg (IOV_MAX is 1024 on Linux)


class Outbox:
    def __init__(self) -> None:
        self._views: deque[memoryview] = deque()
        self.last_progress = time.monotonic()

    def __bool__(self) -> bool:
        return bool(self._views)

    def pending_bytes(self) -> int:
        return sum(v.nbytes for v in self._views)

    def add(self, buffers: Sequence[bytes | memoryview]) -> None:
        if not self._views:
            self.last_progress = time.monotonic()
        for b in buffers:
            v = memoryview(b).cast("B")
            if v.nbytes:
                self._views.append(v)

    def flush(self, sock: socket.socket) -> bool:
        """Write what the socket takes without blocking. True once everything is out.

        Raises OSError when the peer is gone."""
        while self._views:
            try:
                sent = sock.sendmsg(list(_head(self._views, MAX_IOV)))
            except InterruptedError:
                continue
            except BlockingIOError:
                return False
            if sent:
                self.last_progress = time.monotonic()
            while sent:
                head = self._views[0]
                if sent >= head.nbytes:
                    sent -= head.nbytes
                    self._views.popleft()
                else:
                    self._views[0] = head[sent:]
                    sent = 0
        return True

    def stalled(self, now: float) -> bool:
        return bool(self._views) and now - self.last_progress > STALL_S

    def clear(self) -> None:
        self._views.clear()


def _head(views: deque[memoryview], n: int):
    for i, v in enumerate(views):
        if i >= n:
            return
        yield v
