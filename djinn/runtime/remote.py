"""RemoteTensor: a handle to a tensor that lives on the appliance.

Shape, dtype and strides are known locally; the bytes stay remote until ``.cpu()``. When
the RemoteTensor is garbage collected its handle is queued for freeing and the free
rides along with the session's next request (a finalizer must never do I/O: it can run
on any thread, even inside a request holding the channel lock).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch

from djinn.protocol.tensors import parse_dtype

if TYPE_CHECKING:
    from .session import Session


class RemoteTensor:
    __slots__ = (
        "__weakref__",
        "_finalizer",
        "dtype",
        "failed",
        "handle",
        "known",
        "reader",
        "session",
        "shape",
        "storage",
        "strides",
        "view",
        "writer",
    )

    def __init__(self, session: Session, handle: str, meta: dict[str, Any]) -> None:
        self.session = session
        self.handle = handle
        self.dtype: torch.dtype = parse_dtype(meta["dtype"])
        self.shape = torch.Size(meta["shape"])
        self.strides = tuple(meta["strides"])
        # set when an op that should have written into this tensor failed: its value is
        # no longer what the program computed, and reading it raises this (the
        # frontend's Note [failed values])
        self.failed: Exception | None = None
        # may share storage with another handle: True, or the op that made it from
        # handles, to make it again from theirs (Note [lineage truncation])
        self.view: Any = False
        # the frontend node that last wrote into this tensor, perhaps not sent: a read on
        # another thread sends its trace first (Note [writes another thread captured],
        # frontend/writes.py)
        self.writer: Any = None
        # the trace of the thread that last captured an op taking this tensor: a write on
        # another thread sends that trace first (Note [reads another thread captured],
        # frontend/writes.py)
        self.reader: Any = None
        # a copy of its value the client keeps, and the mark of writes into the tensor and
        # its views (Note [values the client knows], frontend/known.py)
        self.known: Any = None
        # the frontend's ``Storage`` mark its tensor shares with views of it, once bound
        # to one: a failed write into any of them is a failure of this value too (Note
        # [a failed write's views], frontend/failures.py)
        self.storage: Any = None
        self._finalizer = weakref.finalize(self, session._free_later, handle)
        rec = getattr(session, "_lineage", None)
        if rec is not None:
            rec.remotes.add(self)

    def rebind(self, handle: str) -> None:
        """Refer to ``handle`` instead: its twin, rebuilt after the worker holding this one
        was lost (Note [lineage journal] in lineage.py)."""
        self._finalizer.detach()
        self.handle = handle
        self._finalizer = weakref.finalize(self, self.session._free_later, handle)

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize

    def cpu(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """Fetch the bytes: a new local tensor with the same values, shape and layout, or
        into ``out`` (same shape and dtype), which saves allocating fresh memory."""
        return self.session.get(self, out=out)

    def free(self) -> None:
        """Release the remote bytes now (also happens when this object is collected)."""
        if self._finalizer.alive:
            self._finalizer.detach()
            self.session.free([self.handle])

    def ref(self) -> dict[str, str]:
        """This tensor as an input of an op graph."""
        return {"$h": self.handle}

    def __repr__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"RemoteTensor(shape={list(self.shape)}, dtype={dtype}, handle={self.handle[:8]}…)"
