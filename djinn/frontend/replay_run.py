"""A recorded call run again (Note [replayable functions], replayable.py): the checks a
replay makes first, the template sent with the inputs' handles as they are now, and the
outputs and gradients it leaves, as a run of the function would.

Note [asynchronous replays]: a replay sends its graph and returns, as a flush nobody
waits on does (Note [asynchronous flushes], inflight.py): its outputs and the gradients it
puts in ``.grad`` are pending outputs of one ``Replayed`` node, which become the kept
handles when the reply lands (before the next flush or request of any thread, or when a
graph that reads them is encoded). It waited for its reply until 2026-11-26, so the worker
sat idle while the client made the outputs, returned, and ran the program up to its next
call (the checks of the next replay included, which now run before anything lands); the
default Adam's step, captured after the replayed forward and backward, waited for them
before its first op was captured. The request is not partial: a node that fails fails
the replay as a whole, which is raised where it lands on the thread that sent it
(another thread's unrelated read that lands it gets its value, as in eager), and the
replay's outputs and every tensor it writes into hold the error from then on (Note
[failed values]: a parameter a failed step half wrote must not be read as if it held the
program's value).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree

from djinn.errors import copy_of
from djinn.protocol import templates
from djinn.runtime.remote import RemoteTensor

from . import inflight, known, writes
from . import trace as trace_mod
from .nodes import Pending
from .replay_followed import followed, replays_ahead
from .replay_key import Miss, param_at
from .replay_outputs import clear_grads, replay_sent
from .replay_sources import holds

if TYPE_CHECKING:
    from .replay_record import Record


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))


def flush_arguments(tr: Any, tensors: list[Any], carry: bool = True) -> None:
    """Send what ``tr`` holds (the call's arguments' own ops run first), keeping on the
    arguments' new handles, with ``carry``, the values the client could compute of them
    (``known.carried``: a slice of an uploaded mask), which the call's reads and a
    replay's checks use."""
    carried = known.carried(tensors, tr) if carry else None
    trace_mod.flush(tr)
    if carried is not None:
        known.keep_carried(carried)


def replay(
    rec: Record, tensors: list[Any], label: str, stats: Any = None, *, checked: bool = False
) -> Any:
    """Run ``rec`` again on ``tensors`` (the call's tensor arguments) by its template, after
    every check (Note [replayable functions]); a Miss if one fails. ``label``: the
    function's name, for errors; ``checked``: its guards were found true on ``tensors``
    just now (Note [values the client knows])."""
    from .session import default_session

    tr = trace_mod.current()
    if tr.nodes:
        # a recording that read no value needs none (a chain of 40 int ops on 65,536
        # elements cost 3.8 ms a call to compute)
        flush_arguments(tr, tensors, carry=bool(rec.guards))
    if (
        not checked
        and rec.guards
        and known.read_now(rec.guards, tensors, tr) != [g.value for g in rec.guards]
    ):
        raise Miss("a value it read is not what it was when recorded")  # known.py
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
    written = [tensors[what] if kind == "arg" else what for kind, what in rec.written]
    for t in written:  # Note [reads another thread captured]: other threads' reads first
        writes.readers_sent_into(t, tr)
    session = default_session()
    # the inputs' handles: a graph in flight may make them. Where a replay is sent behind
    # the last graph (Note [replays sent ahead]; ``ahead``, its flight), an input that one
    # makes lands it (_input), and the handles are read again as it is sent (a landing
    # meanwhile may have rebuilt the session: replay_sent). One whose optimizer steps are
    # captured after it goes as before: the step's graph lands it
    ahead = inflight.land_all(but_last=(not optimizers or bool(rec.plan))
                               and replays_ahead(session))  # fmt: skip
    inputs = [_input(kind, src, h, tensors, session) for (kind, src), h in
              zip(rec.sources, rec.handles, strict=True)]  # fmt: skip
    if rec.fill is None:
        rec.fill = templates.instantiator(rec.tpl)
    whole = _whole_inputs(rec, tensors, session) if optimizers and rec.plan else None
    if whole is not None:
        return followed(rec, tr, (label, stats), tensors, written, inputs, whole, optimizers,
                        ahead)  # fmt: skip
    _node, leaves = replay_sent(rec, tr, label, tensors, written, inputs, ahead=ahead)
    clear_grads(rec)
    if optimizers:
        for opt in optimizers:  # captured as a run of fn would: this step's floats
            opt.step()
        trace_mod.flush(tr, wait=False)  # sent, and run while the caller goes on
    return pytree.tree_unflatten(leaves, rec.out_spec)


def _whole_inputs(rec: Record, tensors: list[Any], session: Any) -> list[RemoteTensor]:
    """The inputs of the whole recording a replay of ``rec`` follows its steps into (Note
    [followed steps], replay_follow.py); a Miss if one is not as recorded (the program
    replaced an optimizer's state: the call records again, and follows the new one)."""
    whole = rec.whole
    return [_input(kind, src, h, tensors, session) for (kind, src), h in
            zip(whole.sources, whole.handles, strict=True)]  # fmt: skip


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
    item = ref.node.inflight if isinstance(ref, Pending) else None
    if item is not None:
        inflight.land(item)  # made by the graph a replay goes behind
        ref = trace_mod.resolved(cell.ref)
    if not isinstance(ref, RemoteTensor) or ref.session is not session:
        raise Miss("an input is not a remote tensor of this session")
    trace = trace_mod.current()  # Note [writes another thread captured]
    if cell.storage is not None:
        writes.writes_sent(cell.storage, trace)
    writes.writes_sent(ref, trace)
    if ref.failed is not None:
        raise copy_of(ref.failed)
    return ref
