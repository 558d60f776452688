"""A recorded call run again (Note [replayable functions], replayable.py): the checks a
replay makes first, the template sent with the inputs' handles as they are now, and the
outputs and gradients it leaves, as a run of the function would.

Note [asynchronous replays]: a replay sends its graph and returns, as a flush nobody
waits on does (Note [asynchronous flushes], trace.py): its outputs and the gradients it
puts in ``.grad`` are pending outputs of one ``Replayed`` node, which become the kept
handles when the reply lands (before the next flush or request of any thread, or when a
graph that reads them is encoded). It waited for its reply until 2026-11-26, so the worker
sat idle while the client made the outputs, returned, and ran the program up to its next
call (the checks of the next replay included, which now run before anything lands); the
default Adam's step, captured after the replayed forward and backward, waited for them
before its first op was captured. The request is not partial: a node that fails fails
the replay as a whole, which is raised where it lands, and the replay's outputs and every
tensor it writes into hold the error from then on (Note [failed values]: a parameter a
failed step half wrote must not be read as if it held the program's value).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree

from djinn.protocol import templates
from djinn.runtime.remote import RemoteTensor

from . import trace as trace_mod
from . import writes
from .meta import TensorSpec
from .nodes import Pending, Replayed
from .replay_key import Miss, param_at
from .replay_sources import holds

if TYPE_CHECKING:
    from .replay_record import Record


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))


def replay(rec: Record, tensors: list[Any], label: str, stats: Any = None) -> Any:
    """Run ``rec`` again on ``tensors`` (the call's tensor arguments) by its template, after
    every check (Note [replayable functions]); a Miss if one fails. ``label``: the
    function's name, for errors."""
    from .session import default_session

    tr = trace_mod.current()
    if tr.nodes:
        trace_mod.flush(tr)  # the arguments' own ops run first
    if not rec.state.same():
        raise Miss("a module, optimizer or tensor it uses changed since")
    for (_k, owner, _spec), empty in zip(rec.grads, rec.empty, strict=True):
        if empty is None or (owner._grad is None) != empty:  # a run would accumulate
            raise Miss("a .grad it sets was not as it was when recorded")
    for w, recorded in rec.external:
        now = w()
        if now is None or not same_bytes(now, recorded):
            raise Miss("a local tensor it reads changed since")
    optimizers = [w() for w in rec.steps]
    if any(opt is None for opt in optimizers):
        raise Miss("an optimizer it steps is gone")
    if any(getattr(param_at(w), "_grad", None) is not None for w in rec.nones):
        raise Miss("a .grad it found empty is not")  # the call found it None
    trace_mod.land_all()  # the inputs' handles: a graph in flight may make them
    session = default_session()
    inputs = [_input(kind, src, h, tensors, session) for (kind, src), h in
              zip(rec.sources, rec.handles, strict=True)]  # fmt: skip
    handles = [r.handle for r in inputs]
    if rec.fill is None:
        rec.fill = templates.instantiator(rec.tpl)
    written = [tensors[what] if kind == "arg" else what for kind, what in rec.written]
    form = (rec.fingerprint, handles, rec.scalars)
    whole = _whole_inputs(rec, tensors, session) if optimizers and rec.plan else None
    if whole is not None:
        return _followed(rec, tr, (label, stats), tensors, written, (inputs, form), whole,
                         optimizers)  # fmt: skip
    body = rec.fill(handles, rec.scalars)
    node = Replayed(f"a replay of {label}", tr, len(body["keep"]), tuple(t._ref for t in written))
    with trace_mod.replay_in_flight(tr, node, body, rec.inline, form, inputs):  # runs as we go on
        for t in written:  # as eager's in-place ops count (autograd checks them)
            torch.autograd.graph.increment_version(t)
        leaves = _bind_outputs(rec, node, tensors)
    _clear(rec)
    if optimizers:
        for opt in optimizers:  # captured as a run of fn would: this step's floats
            opt.step()
        trace_mod.flush(tr, wait=False)  # sent, and run while the caller goes on
    return pytree.tree_unflatten(leaves, rec.out_spec)


def _bind_outputs(
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


def _clear(rec: Record) -> None:
    for w in rec.clears:  # as the call did (zero_grad)
        p = param_at(w)
        if p is not None:
            p.grad = None


def _whole_inputs(rec: Record, tensors: list[Any], session: Any) -> list[RemoteTensor]:
    """The inputs of the whole recording a replay of ``rec`` follows its steps into (Note
    [followed steps], replay_follow.py); a Miss if one is not as recorded (the program
    replaced an optimizer's state: the call records again, and follows the new one)."""
    whole = rec.whole
    return [_input(kind, src, h, tensors, session) for (kind, src), h in
            zip(whole.sources, whole.handles, strict=True)]  # fmt: skip


def _followed(
    rec: Record,
    tr: Any,
    called: tuple[str, Any],
    tensors: list[Any],
    written: list[Any],
    split: tuple[list[RemoteTensor], Any],
    inputs: list[RemoteTensor],
    optimizers: list[Any],
) -> Any:
    """Replay ``rec`` with its steps followed (Note [followed steps]): the whole
    recording's template goes with this call's floats, or, if the steps part from their
    plan, ``rec`` goes as it would have and the steps are captured."""
    from .replay_follow import Follower
    from .trace import bind

    whole, plan = rec.whole, rec.plan
    label, stats = called
    handles = [r.handle for r in inputs]
    writes = [tensors[what] if kind == "arg" else what() for kind, what in whole.written]
    writes = [t for t in writes if t is not None]  # one dropped since holds no error
    node = Replayed(f"a replay of {label}", tr, len(whole.tpl["keep"]),
                    tuple(t._ref for t in writes))  # fmt: skip
    for t in written:  # the ops before the steps; the steps' own count as they are called
        torch.autograd.graph.increment_version(t)
    bound: list[tuple[Any, int]] = []
    leaves = _bind_outputs(whole, node, tensors, bound)
    _clear(rec)

    def stop() -> None:  # the split replay, as it would have gone, and its outputs bound
        split_inputs, form = split
        body = rec.fill(form[1], rec.scalars)
        alone = Replayed(f"a replay of {label}", tr, len(body["keep"]),
                         tuple(t._ref for t in written))  # fmt: skip
        with trace_mod.replay_in_flight(tr, alone, body, rec.inline, form, split_inputs):
            for t, k in bound:
                bind(t, Pending(alone, plan.slots[k]))

    follower = Follower(plan, tr, node, inputs, stop)
    follower.start()
    try:
        for opt in optimizers:
            opt.step()
    except BaseException:
        follower.abort("a step raised")
        if stats is not None:
            stats.captured[follower.why] += 1
        raise
    if follower.finish():
        if stats is not None:
            stats.followed += 1
        scalars = whole.scalars[: plan.s_cut] + follower.floats
        if whole.fill is None:
            whole.fill = templates.instantiator(whole.tpl)
        body = whole.fill(handles, scalars)
        with trace_mod.replay_in_flight(tr, node, body, whole.inline,
                                        (whole.fingerprint, handles, scalars), inputs):  # fmt: skip
            pass
    else:
        if stats is not None:
            stats.captured[follower.why] += 1
        if follower.replaced:  # its steps read other tensors than recorded: stop trying
            rec.plan = rec.whole = None
        trace_mod.flush(tr, wait=False)
    return pytree.tree_unflatten(leaves, rec.out_spec)


def _input(kind: str, src: Any, recorded: str, tensors: list[Any], session: Any) -> RemoteTensor:
    """The value an input of the graph has now (a Miss if it is not what it was)."""
    if kind == "arg":
        cell = tensors[src].__dict__["_b"]
    elif kind == "grad":
        grad = src._grad
        cell = None if grad is None else grad.__dict__["_b"]
    else:
        cells = [w() for w in src]
        if not all(holds(c, recorded) for c in cells):
            raise Miss("a tensor it reads was replaced or dropped since")
        cell = cells[0]
    ref = None if cell is None else trace_mod.resolved(cell.ref)
    if not isinstance(ref, RemoteTensor) or ref.session is not session:
        raise Miss("an input is not a remote tensor of this session")
    trace = trace_mod.current()  # Note [writes another thread captured]
    if cell.storage is not None:
        writes.writes_sent(cell.storage, trace)
    writes.writes_sent(ref, trace)
    if ref.failed is not None:
        raise ref.failed
    return ref
