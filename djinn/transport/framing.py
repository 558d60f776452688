"""Reading and writing frames on a socket, blocking or not.

``FrameReader`` is one state machine for both sides: the client drives it on a blocking
socket, the appliance on a non-blocking one from its selector loop. Small frames are read
through one buffer (one ``recv`` usually holds a whole request); a payload is received
straight into the buffers a *sink* chooses once the body is known, which is how a TCP
client's tensor bytes land in an arena slab with no intermediate copy.
"""

from __future__ import annotations

import selectors
import socket
from collections.abc import Callable, Sequence
from typing import Any

from djinn.errors import DjinnError, FrameTooLarge
from djinn.protocol.frames import (
    HEADER_SIZE,
    Frame,
    Header,
    decode_body,
    decode_header,
    segment_lengths,
)

BUFFER_SIZE = 256 << 10
_DISCARD = memoryview(bytearray(1 << 20))

# sink(header, body, segment_lengths) -> writable buffers, one per segment
Sink = Callable[[Header, dict[str, Any], list[int]], Sequence[memoryview]]


class PeerClosed(ConnectionError):
    """The peer closed the connection (cleanly or not)."""


def default_sink(_header: Header, _body: dict[str, Any], lengths: list[int]) -> list[memoryview]:
    return [memoryview(bytearray(n)) for n in lengths]


class FrameReader:
    """Incremental frame reader. ``poll()`` returns a Frame, or None if it would block."""

    def __init__(
        self,
        sock: socket.socket,
        *,
        authenticated: bool = False,
        max_payload: int | None = None,
        buffer_size: int = BUFFER_SIZE,
    ) -> None:
        self.sock = sock
        self.authenticated = authenticated
        self.max_payload = max_payload  # tighter than MAX_PAYLOAD for peers that send none
        self.sink: Sink = default_sink
        self._buf = bytearray(buffer_size)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0
        self._reset()

    def _reset(self) -> None:
        self._header: Header | None = None
        self._body: dict[str, Any] | None = None
        self._targets: list[memoryview] = []
        self._target_index = 0
        self._target_pos = 0
        self._sink_error: DjinnError | None = None
        self._discard_left = 0
        self._large: bytearray | None = None
        self._large_pos = 0

    # -- buffered part: header and body ----------------------------------------------
    def _fill(self) -> bool:
        """Read more into the buffer; False if it would block. Raises PeerClosed."""
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):
            n = self._end - self._start
            self._buf[:n] = self._buf[self._start : self._end]
            self._start, self._end = 0, n
        try:
            got = self.sock.recv_into(self._view[self._end :])
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:  # reset, timed out, unreachable...: the peer is gone
            raise PeerClosed(str(exc)) from None
        if got == 0:
            raise PeerClosed("peer closed the connection")
        self._end += got
        return True

    def _take(self, n: int) -> memoryview | None:
        """n buffered bytes (n <= BUFFER_SIZE) or None if they have not all arrived."""
        while self._end - self._start < n:
            if not self._fill():
                return None
        out = self._view[self._start : self._start + n]
        self._start += n
        return out

    def buffered(self) -> int:
        return self._end - self._start

    def poll(self) -> Frame | None:
        if self._header is None:
            raw = self._take(HEADER_SIZE)
            if raw is None:
                return None
            header = decode_header(raw, authenticated=self.authenticated)
            if self.max_payload is not None and header.payload_len > self.max_payload:
                raise FrameTooLarge(
                    f"payload of {header.payload_len} bytes; this endpoint accepts at most "
                    f"{self.max_payload}"
                )
            self._header = header
        header = self._header
        if self._body is None:
            if header.body_len > len(self._buf):
                raw = self._take_large(header.body_len)
            else:
                raw = self._take(header.body_len)
            if raw is None:
                return None
            self._body = decode_body(raw)
            lengths = segment_lengths(self._body, header.payload_len)
            try:
                self._targets = list(self.sink(header, self._body, lengths))
            except DjinnError as exc:
                # Keep the stream in step: swallow the payload, then report the error.
                self._sink_error = exc
                self._discard_left = header.payload_len
        done = self._discard_payload() if self._sink_error else self._read_payload()
        if not done:
            return None
        if self._sink_error is not None:
            frame = Frame(header, {}, [], error=self._sink_error)
        else:
            frame = Frame(header, self._body, self._targets)
        self._reset()
        return frame

    def _take_large(self, n: int) -> memoryview | None:
        """A body bigger than the read buffer: gather it into its own bytearray."""
        if self._large is None:
            self._large = bytearray(n)
            self._large_pos = 0
        buf = memoryview(self._large)
        while self._large_pos < n:
            k = min(self._end - self._start, n - self._large_pos)
            if k:
                buf[self._large_pos : self._large_pos + k] = self._view[
                    self._start : self._start + k
                ]
                self._start += k
                self._large_pos += k
            elif not self._fill():
                return None
        self._large = None
        return buf

    def _recv_into(self, dst: memoryview) -> int | None:
        try:
            got = self.sock.recv_into(dst)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError as exc:
            raise PeerClosed(str(exc)) from None
        if got == 0:
            raise PeerClosed("peer closed the connection mid-frame")
        return got

    def _read_payload(self) -> bool:
        """Fill the sink's buffers: buffered bytes first, then straight from the socket."""
        while self._target_index < len(self._targets):
            target = self._targets[self._target_index]
            if self._target_pos >= len(target):
                self._target_index += 1
                self._target_pos = 0
                continue
            k = min(self._end - self._start, len(target) - self._target_pos)
            if k:
                target[self._target_pos : self._target_pos + k] = self._view[
                    self._start : self._start + k
                ]
                self._start += k
                self._target_pos += k
                continue
            got = self._recv_into(target[self._target_pos :])
            if got is None:
                return False
            self._target_pos += got
        return True

    def _discard_payload(self) -> bool:
        while self._discard_left:
            k = min(self._end - self._start, self._discard_left)
            if k:
                self._start += k
                self._discard_left -= k
                continue
            got = self._recv_into(_DISCARD[: min(len(_DISCARD), self._discard_left)])
            if got is None:
                return False
            self._discard_left -= got
        return True


WRITE_TIMEOUT_S = 30.0  # a peer that takes no byte of a reply for this long is gone


def send_buffers(
    sock: socket.socket, buffers: Sequence[bytes | memoryview], timeout: float = WRITE_TIMEOUT_S
) -> None:
    """Write every buffer, in order, with as few syscalls as the kernel allows.

    On a non-blocking socket this waits (``poll``, so any descriptor number works) up to
    ``timeout`` for room each time the kernel's buffer is full; a socket with its own
    timeout raises ``TimeoutError`` from ``sendmsg`` itself."""
    views = [memoryview(b).cast("B") for b in buffers if len(memoryview(b))]
    while views:
        try:
            sent = sock.sendmsg(views[:512])
        except InterruptedError:
            continue
        except BlockingIOError:
            _wait_writable(sock, timeout)
            continue
        while sent:
            if sent >= len(views[0]):
                sent -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0


def _wait_writable(sock: socket.socket, timeout: float = WRITE_TIMEOUT_S) -> None:
    # select.select() refuses descriptors >= FD_SETSIZE (1024), which a busy appliance
    # reaches; a selector (epoll/poll) has no such limit.
    with selectors.DefaultSelector() as sel:
        sel.register(sock, selectors.EVENT_WRITE)
        if not sel.select(timeout):
            raise PeerClosed(f"peer stopped reading for {timeout:.0f} s")
