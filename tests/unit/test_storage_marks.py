"""Note [writes another thread captured] (djinn/frontend/writes.py): the ``Storage`` mark
a tensor shares with its views is made once, whole, on first use."""

from __future__ import annotations

import threading
import time

from djinn.frontend import nodes, writes


class _Tensorish:
    """What ``shared_storage`` looks at: a cell in ``__dict__``."""


def test_two_threads_making_a_tensors_storage_mark_at_once_share_one(monkeypatch):
    """Two threads making the mark at once each made one, and the marks put on the one
    overwritten were lost. The first construction here waits until the second thread
    is about to make its own."""
    second_at_it = threading.Event()
    made: list = []

    class Slow(nodes.Storage):
        def __init__(self) -> None:
            super().__init__()
            if not made:
                made.append(self)
                second_at_it.wait(0.5)  # with the lock, the second waits for this one

    x = _Tensorish()
    x.__dict__["_b"] = nodes.Binding(None)
    monkeypatch.setattr(writes, "Storage", Slow)
    got: list = []
    first = threading.Thread(target=lambda: got.append(writes.shared_storage(x)))
    first.start()
    while not made:
        time.sleep(0.001)
    second_at_it.set()
    got.append(writes.shared_storage(x))
    first.join()
    assert got[0] is got[1] is x.__dict__["_b"].storage


def test_a_mark_made_after_reads_starts_with_their_readers():
    """A tensor read whole, then given its first view: the mark starts with the handle's
    readers (an inference tensor's view has no ``_base``; a write through it looks at
    the mark alone)."""
    from djinn.runtime.remote import RemoteTensor

    ref = RemoteTensor.__new__(RemoteTensor)
    ref.reader = reader = object()
    x = _Tensorish()
    x.__dict__["_b"] = nodes.Binding(ref)
    assert writes.shared_storage(x).reader is reader
