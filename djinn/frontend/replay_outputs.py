"""What a replay leaves as a run of the function would (Note [replayable functions]): its
graph sent, its outputs and the gradients it puts in ``.grad`` pointed at the replayed
node's kept values, and the gradients the call cleared."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from djinn.protocol import templates

from . import inflight, writes
from .meta import TensorSpec
from .nodes import Pending, Replayed
from .replay_key import param_at

if TYPE_CHECKING:
    from .replay_record import Record


def replay_sent(
    rec: Record,
    tr: Any,
    label: str,
    tensors: list,
    written: list,
    inputs: list,
    *,
    ahead: Any = None,
) -> tuple[Replayed, list[Any]]:
    """``rec`` sent as a replay without waiting (Note [asynchronous replays]) on ``inputs``
    (RemoteTensors), and bound: its node, and the leaves of its result. ``written``: the
    tensors it writes into; ``ahead``: the flight it goes behind (Note [replays sent
    ahead])."""
    form, body = replay_body(rec, inputs)
    node = Replayed(f"a replay of {label}", tr, body.keep, tuple(t._ref for t in written))
    inline = rec.inline_now()
    with inflight.replay_in_flight(tr, node, body, inline, form, inputs, ahead=ahead):
        for t in written:  # as eager's in-place ops count (autograd checks them)
            torch.autograd.graph.increment_version(t)
            writes.forget_known(t)
        leaves = bind_outputs(rec, node, tensors)
    return node, leaves


def replay_body(rec: Record, inputs: list) -> tuple[tuple, Any]:
    """``rec``'s template form and body on ``inputs``' handles as they are as it is sent: a
    landing since they were read (the graph a replay goes behind, while its steps were
    followed) may have rebuilt the session and renamed them."""
    handles = [r.handle for r in inputs]
    body = templates.filled(rec.tpl, rec.fill, handles, rec.scalars)
    return (rec.fingerprint, handles, rec.scalars), body


def bind_outputs(
    rec: Record, node: Any, tensors: list[Any], bound: list | None = None
) -> list[Any]:
    """Point the gradients ``rec`` leaves in ``.grad`` and its outputs at ``node``'s kept
    values (a view sharing its storage as recorded: Note [writes another thread
    captured]); the result's leaves. ``bound`` gets each (tensor, kept slot)."""
    from .lazy import LazyTensor

    for k, owner, (dtype, shape, stride, offset) in rec.grads:
        spec = TensorSpec(dtype, shape, stride, offset, None)
        owner.grad = LazyTensor(spec, Pending(node, k))
        if bound is not None:
            bound.append((owner._grad, k))
    leaves: list[Any] = []
    made: dict[tuple, Any] = {}  # an output returned twice is one tensor, as in eager
    for i, (kind, what) in enumerate(rec.outputs):
        if kind == "value":
            leaves.append(what)
            continue
        k, (dtype, shape, stride, offset) = what
        if what not in made:
            spec = TensorSpec(dtype, shape, stride, offset, None)
            made[what] = LazyTensor(spec, Pending(node, k))
            share = rec.shares.get(i)
            if share is not None:
                made[what].__dict__["_b"].storage = (
                    writes.shared_storage(tensors[share[1]]) if type(share) is tuple else share
                )
            if bound is not None:
                bound.append((made[what], k))
        leaves.append(made[what])
    return leaves


def clear_grads(rec: Record) -> None:
    for w in rec.clears:  # as the call did (zero_grad)
        p = param_at(w)
        if p is not None:
            p.grad = None
