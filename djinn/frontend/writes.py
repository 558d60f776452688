"""What a captured op writes into: the bases of the views it writes (Note [failed
values]), and which node, on which thread's trace, holds a write into a handle (Note
[writes another thread captured]).

Note [writes another thread captured]: an op captured on one thread that writes into a
tensor bound to a handle (an optimizer's step into the parameters) leaves it bound to that
handle, the write pending in that thread's trace. A read of the handle on another thread
fetched the value without it: a model trained on a thread and read on the main one came
back a step behind (a review, 2026-11-27: every parameter 4e-3 to 1e-2 off local
eager's), and a thread that ended without a read never sent its last step at all. So the
handle names the node that last wrote into it (``record_writes``), and a read elsewhere sends
that node's trace first while the node is not sent (``writes_sent``), as a read of
another thread's pending value does (``lazy.ref_for_node``). The session runs its
requests in the order they are sent, so the read sees the write.
"""

from __future__ import annotations

from typing import Any

import torch

from djinn.runtime.remote import RemoteTensor

from .failures import written_args, written_values
from .nodes import Node
from .trace import Trace, flush


def writes_sent(ref: RemoteTensor, trace: Trace) -> None:
    """Send the trace holding the last write captured into ``ref``, if that write is
    another thread's and not sent yet. The node, not its trace, is what the handle names:
    naming the trace flushed whatever that thread was capturing at every read, long after
    the write had gone (a review: a thread polling a parameter every ms cut a replayable
    trainer's every recording short, 0 replays in 100 calls against 97)."""
    node = ref.writer
    if node is None:
        return
    if node.executed or node.inflight is not None or node.failed is not None:
        ref.writer = None  # sent: the session runs it before anything read after it
    elif node.trace is not trace:
        # not while a replayable call records there (decided under the trace's lock, as
        # the recording starts under it): a read racing a call that has not returned may
        # see the value from before it, as in eager, and once the call returns its
        # recording has sent the write; cut short, it would never replay
        flush(node.trace, wait=False, unless_recording=True)


def record_writes(node: Node, func: Any, args: tuple, kwargs: dict) -> None:
    """What captured ``node`` (``func``) writes into, in one walk of its written values:
    ``node.bases``, the values of the bases of the views it writes into, as they are now
    (a later ``.data =`` on a base does not move them: a failed write leaves them stale
    too, Note [failed values], failures.poison_writes); and the handles it writes into,
    those bases' too, name ``node`` as their writer. The foreach and fused optimizer
    families' lists of parameters are not looked at for bases: a ``_base`` read each per
    step."""
    if not written_args(func):
        return
    optimizer = func._schema.name.startswith(("aten::_foreach_", "aten::_fused_"))
    bases: list[Any] = []
    for t in written_values(func, args, kwargs):
        if not isinstance(t, torch.Tensor):
            continue
        base = None if optimizer else t._base
        if base is not None and "_b" in t.__dict__:
            bases.append(base.__dict__["_b"].ref)
        for u in (t,) if base is None else (t, base):
            ref = getattr(u.__dict__.get("_b"), "ref", None)
            if type(ref) is RemoteTensor:
                ref.writer = node
    node.bases = tuple(bases)
