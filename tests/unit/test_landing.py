"""Note [results before executed] (djinn/frontend/trace.py): a node that lands is read by
other threads without a lock, so it is never seen executed before its kept results are in
place."""

from __future__ import annotations

import torch

from djinn.frontend import trace as trace_mod
from djinn.frontend.nodes import Node, Pending, ran

EXECUTED = Node.__dict__["executed"]  # the slot's own descriptor


class _Kept:
    """What a kept output names (a RemoteTensor's part that ``resolved`` reads)."""

    failed = None


def test_a_node_seen_executed_already_has_its_kept_results():
    """Another thread that reads the node's output the moment it becomes executed (here:
    a hook on the flag, run by the landing itself) gets the kept value. It raised "its
    value was released before it was read" twice in about 7,400 training steps of a
    trainer thread whose gradients another thread read."""
    seen: list[object] = []

    class Watched(Node):
        __slots__ = ()

        @property
        def executed(self) -> bool:
            return EXECUTED.__get__(self)

        @executed.setter
        def executed(self, value: bool) -> None:
            EXECUTED.__set__(self, value)
            if value:  # what a reader on another thread finds now
                seen.append(trace_mod.resolved(Pending(self, 0)))

    node = Watched(torch.ops.aten.clone.default, [], {}, trace_mod.Trace(), 1)
    kept = _Kept()
    ran([node], [(node, 0, [])], [kept], None)
    assert seen == [kept]
    assert trace_mod.resolved(Pending(node, 0)) is kept
