"""Where a session's frame payload is received on a worker (Note [receive slabs]).

Note [receive slabs]: a payload arrives over many reads, and between them the worker's
loop serves every other session. The slabs it is received into therefore belong to
*this* session (``s.frame_slabs``) and only this session's own dispatch, or its end,
frees them: no other session's frame may touch them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from djinn.errors import FrameTooLarge
from djinn.protocol.frames import Header, Kind
from djinn.transport.framing import default_sink

from .sessions import OPEN, WorkerSession

if TYPE_CHECKING:
    from .worker import Worker

MAX_INLINE_FRAME = 256 << 20  # payload bytes one frame may make the worker buffer privately


def sink(w: Worker, s: WorkerSession, header: Header, body: dict, lengths: list[int]) -> list:
    """Where a frame's payload goes: bulk PUT segments straight into arena slabs."""
    free_frame_slabs(w, s)  # left over from a frame that never reached dispatch
    if header.kind == Kind.PUT and s.state == OPEN:
        targets = []
        for k, n in enumerate(lengths):
            if n > w.inline_max:
                off = w.store.slabs.alloc(n, s.id)
                s.frame_slabs[k] = off
                targets.append(w.store.arena.slab(off, n))
            else:
                targets.append(memoryview(bytearray(n)))
        return targets
    private = sum(lengths)
    if private > MAX_INLINE_FRAME:
        raise FrameTooLarge(f"{private} inline payload bytes; send bulk tensors with PUT")
    if private:
        # Inline payload is worker memory for as long as the frame is being received
        # (a client may send half of it and stop): the stack segment pays for it.
        w.store.vmu["stack"].reserve(private)
        s.frame_private = private
    return default_sink(header, body, lengths)


def free_frame_slabs(w: Worker, s: WorkerSession) -> None:
    """Give back the receive slabs of ``s``'s current frame that no handle adopted, and
    the stack bytes its inline payload was charged."""
    for off in s.frame_slabs.values():
        w.store.slabs.free(off)
    s.frame_slabs.clear()
    if s.frame_private:
        w.store.vmu["stack"].release(s.frame_private)
        s.frame_private = 0
