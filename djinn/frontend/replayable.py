"""Replayable functions: a call captured once, then run again by its graph template.

Note [replayable functions]: capture costs the client a Python ``__torch_dispatch__`` per
op, and that dispatch alone is most of it (``benchmarks/capture.py``: warm capture sits at
0.85-0.91x of a bare wrapper subclass that only builds its outputs, 27-33 µs per op on a
2-core host). No per-op guard can go under that floor, so a forward repeated with new
inputs cost the client as much as the first. ``djinn.replayable(fn)`` skips the ops
altogether, the way a CUDA graph replays its kernels: a call of ``fn`` is captured as one
graph and kept on the appliance as a template (Note [graph templates]); a later call with
arguments of the same kinds sends the template's fingerprint, its input handles and its
floats, and wraps the kept outputs in new LazyTensors. The client's cost no longer grows
with the op count, nor do the bytes on the wire.

The contract is a CUDA graph's: what ``fn`` computes must follow from its tensor
arguments and the remote tensors it reads (model weights, updated in place or not), with
its Python-side state (a learning rate in a dict, a flag on a module) as it was when
recorded. What can be checked is checked, and a call that fails a check simply runs
``fn`` as before (``stats()`` counts why):

- the *key*: each argument's kind (a remote tensor's dtype, shape, strides, offset and
  ``requires_grad``; any other argument by value), which arguments are the same tensor,
  grad and inference mode, autocast, the session; for the modules ``fn`` is, is a method
  of, or names (in its closure, or globals its code reads) each one's train/eval flag and
  which tensors are its parameters and buffers (``model.weight = Parameter(..)``
  reassigned), and for the optimizers it names their parameters and hyperparameters (a
  scheduler's new learning rate); a new key records again;
- a recording is replayable only if ``fn`` read no value (a ``.item()`` or ``.cpu()`` can
  steer Python), drew no random numbers (a replay would repeat them), made no tensor with
  an autograd history (a replay builds none), captured every op in one graph (its own
  and its backward pass's), returned only tensors it made (and plain values), and left
  no other tensor it made alive but gradients in ``.grad`` (``self.cache = x``: a replay
  could not set it);
- a key replays only after ``after`` recordings in a row gave the same graph, the same
  floats and inline tensors, the same inputs and the same outputs: a float that changes
  from call to call (an optimizer's bias correction) is Python state a replay would
  freeze, so that key keeps recording;
- each input a replay reads besides the arguments (a weight) must still be what the
  tensor that held it at recording holds: the same binding (Note [bindings]) bound to the
  same handle. A tensor replaced (``p.data = ...``), written in place since (an optimizer
  step rebinds it), or dropped makes the key record again.

A training step replays too: its backward pass, which PyTorch runs on its device thread
while ``fn`` waits, joins the recording's graph, and the gradients it leaves in ``.grad``
of the tensors it read are set again by each replay (``opt.zero_grad()`` belongs inside
``fn``: outside, it drops them and every call records). An optimizer's first step makes
its state, so it records from the second call; an optimizer whose step computes Python
floats that change each step (the default ``Adam``'s bias corrections) never replays,
while ``Adam(capturable=True)`` and ``SGD`` do.

What cannot be checked is other Python state ``fn`` reads that changes later while every
tensor stays the same (a flag on an object it does not name, a float a hook reads): a
replay uses the recorded value, as a CUDA graph does. ``reset()`` forgets every
recording.

A replay runs every op the recorded call ran, in order, with every check of the
appliance (the template is instantiated there exactly as if sent whole), so its results
are the bits a capture of the same call would give.
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from djinn.protocol import templates
from djinn.runtime.remote import RemoteTensor

from . import trace as trace_mod
from .meta import TensorSpec
from .nodes import Pending

DEVICE_TYPE = "remote_accelerator"
# what a call may return besides tensors, as recorded: immutable values
PLAIN = (bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)


class _Miss(Exception):
    """This call cannot replay or record: ``fn`` runs as it is (the reason is counted)."""


@dataclass
class _Record:
    """One recorded call: the graph's template and what fills it in."""

    fingerprint: str
    tpl: dict[str, Any]
    scalars: list[float]
    inline: list[torch.Tensor]
    sources: list[tuple[str, Any]]  # per input: ("arg", i) or ("held", weakref to a Binding)
    handles: list[str]  # the input handles: as recorded, or as the last replay left them
    outputs: list[tuple[str, Any]]  # per result leaf: ("kept", (k, spec)) or ("value", v)
    out_spec: Any
    # gradients it left in .grad: per kept slot, weakrefs to the Bindings that hold it
    grads: list[tuple[int, list[Any]]] = field(default_factory=list)
    same: int = 1  # recordings in a row that gave this record
    ops: int = 0

    def matches(self, other: _Record) -> bool:
        return (
            self.fingerprint == other.fingerprint
            and self.scalars == other.scalars
            and self.handles_shape() == other.handles_shape()
            and self.outputs == other.outputs
            and self.out_spec == other.out_spec
            and [k for k, _ in self.grads] == [k for k, _ in other.grads]
            and len(self.inline) == len(other.inline)
            and all(_same_bytes(a, b) for a, b in zip(self.inline, other.inline, strict=True))
        )

    def handles_shape(self) -> list[Any]:
        """Sources, with a held input named by its handle (an argument's changes)."""
        return [
            ("arg", s[1]) if s[0] == "arg" else ("held", h)
            for s, h in zip(self.sources, self.handles, strict=True)
        ]


@dataclass
class _Stats:
    calls: int = 0
    replays: int = 0
    recordings: int = 0
    plain: Counter = field(default_factory=Counter)  # calls run as they are, by reason


class Replayable:
    """``fn`` made replayable (Note [replayable functions]); see ``djinn.replayable``."""

    def __init__(self, fn: Callable[..., Any], *, after: int = 2) -> None:
        if not callable(fn):
            raise TypeError(f"replayable() takes a function, got {type(fn).__name__}")
        if type(after) is not int or after < 1:
            raise ValueError("after must be an integer of at least 1")
        self.fn = fn
        self.after = after
        self._records: dict[Any, _Record | str] = {}
        self._stats = _Stats()
        self._lock = threading.RLock()  # one call records or replays at a time
        self.__wrapped__ = fn
        self.__doc__ = getattr(fn, "__doc__", None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            self._stats.calls += 1
            try:
                key, tensors = _key(args, kwargs, self.fn)
            except _Miss as why:
                self._stats.plain[str(why)] += 1
                return self.fn(*args, **kwargs)
            rec = self._records.get(key)
            if isinstance(rec, str):  # this key can never replay: say why once more
                self._stats.plain[rec] += 1
                return self.fn(*args, **kwargs)
            if rec is not None and rec.same >= self.after:
                try:
                    out = _replay(rec, tensors)
                except _Miss as why:
                    self._stats.plain[str(why)] += 1
                    del self._records[key]  # record afresh
                else:
                    self._stats.replays += 1
                    return out
            return self._record(key, args, kwargs, tensors)

    def reset(self) -> None:
        """Forget every recording: the next calls record again (after a change to Python
        state the function reads, such as a learning rate)."""
        with self._lock:
            self._records.clear()

    def stats(self) -> dict[str, Any]:
        """Calls, replays, recordings, and the calls run as they are by reason."""
        s = self._stats
        return {
            "calls": s.calls,
            "replays": s.replays,
            "recordings": s.recordings,
            "plain": dict(s.plain),
            "keys": len(self._records),
        }

    def _record(self, key: Any, args: tuple, kwargs: dict, tensors: list[Any]) -> Any:
        tr = trace_mod.current()
        trace_mod.flush(tr)  # what came before runs first: the graph holds fn's ops only
        nodes = tr.nodes
        chunk, tr.chunk_ops = tr.chunk_ops, 0  # one graph (Note [streamed graphs])
        reads: dict[str, Any] = {}
        tr.reads = reads
        outer, trace_mod.RECORDING = trace_mod.RECORDING, (threading.get_ident(), tr)
        try:
            result = self.fn(*args, **kwargs)
        finally:
            trace_mod.RECORDING = outer
            tr.chunk_ops = chunk
            tr.reads = None
        try:
            rec = _recorded(tr, nodes, result, tensors, reads)
        except _Miss as why:
            self._stats.plain[str(why)] += 1
            if getattr(why, "final", False):
                self._records[key] = str(why)
            return result
        self._stats.recordings += 1
        old = self._records.get(key)
        if isinstance(old, _Record) and old.matches(rec):
            rec.same = old.same + 1
        self._records[key] = rec
        return result


def replayable(fn: Callable[..., Any] | None = None, *, after: int = 2) -> Any:
    """Make ``fn`` replayable (Note [replayable functions]): calls after the first
    ``after`` identical recordings send the recorded graph by fingerprint instead of
    capturing every op. Usable as ``@djinn.replayable`` or ``djinn.replayable(after=3)``."""
    if fn is None:
        return lambda f: Replayable(f, after=after)
    return Replayable(fn, after=after)


# -- the key -----------------------------------------------------------------------------
def _key(args: tuple, kwargs: dict, fn: Any) -> tuple[Any, list[Any]]:
    from .lazy import LazyTensor

    leaves, spec = pytree.tree_flatten((args, kwargs))
    parts: list[Any] = []
    tensors: list[Any] = []
    for x in leaves:
        if isinstance(x, LazyTensor):
            same = next((j for j, t in enumerate(tensors) if t is x), len(tensors))
            parts.append(
                (
                    "T",
                    x.dtype,
                    tuple(x.shape),
                    tuple(x.stride()),
                    x.storage_offset(),
                    x.requires_grad,
                    same,
                )
            )
            tensors.append(x)
        elif isinstance(x, torch.Tensor):
            raise _Miss("a local tensor argument (its values would be frozen)")
        else:
            try:
                hash(x)
            except TypeError:
                raise _Miss(f"an unhashable {type(x).__name__} argument") from None
            parts.append(("V", type(x), x))
    from .session import default_session

    mode = (
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        torch.is_autocast_enabled(DEVICE_TYPE),
        torch.get_autocast_dtype(DEVICE_TYPE),
        _modules_state(fn),
    )
    try:
        return (str(spec), tuple(parts), mode, id(default_session())), tensors
    except TypeError:
        raise _Miss("an unhashable argument") from None


STATEFUL = (torch.nn.Module, torch.optim.Optimizer)


def _objects_of(fn: Any) -> list[Any]:
    """The modules and optimizers ``fn`` is, is a method of, or names: in its closure or,
    by a name its code reads, in its globals (``lambda x: model(x)``)."""
    if isinstance(fn, STATEFUL):
        return [fn]
    found = [m] if isinstance(m := getattr(fn, "__self__", None), STATEFUL) else []
    fn = getattr(fn, "__func__", fn)
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # a cell not yet filled
            continue
        if isinstance(value, STATEFUL):
            found.append(value)
    code, names = getattr(fn, "__code__", None), getattr(fn, "__globals__", {})
    for name in getattr(code, "co_names", ()):
        if isinstance(value := names.get(name), STATEFUL):
            found.append(value)
    return found


def _modules_state(fn: Any) -> tuple:
    """What of ``fn``'s modules and optimizers changes what it computes without a tensor
    changing in place: each module's train/eval flag (batch norm, dropout) and which
    tensor objects are its parameters and buffers (``module.weight = Parameter(...)``);
    each optimizer's hyperparameters (a scheduler's learning rate) and parameters."""
    state: list[Any] = []
    for obj in _objects_of(fn):
        if isinstance(obj, torch.nn.Module):
            state.append(tuple(m.training for m in obj.modules()))
            state.append(tuple(id(t) for t in obj.parameters()))
            state.append(tuple(id(t) for t in obj.buffers()))
            continue
        for group in obj.param_groups:
            state.append(tuple(id(p) for p in group["params"]))
            state.append(
                tuple((k, v) for k, v in sorted(group.items()) if k != "params" and _plain(v))
            )
    return tuple(state)


def _plain(v: Any) -> bool:
    """A hyperparameter held as a Python value (a tensor one changes in place)."""
    if isinstance(v, tuple):
        return all(_plain(x) for x in v)
    return v is None or type(v) in PLAIN


# -- recording ---------------------------------------------------------------------------
def _final(why: str) -> _Miss:
    """A reason this key can never replay: it stops recording."""
    exc = _Miss(why)
    exc.final = True  # type: ignore[attr-defined]
    return exc


def _recorded(
    tr: Any, nodes: list[Any], result: Any, tensors: list[Any], reads: dict[str, Any]
) -> _Record:
    """Check the call just captured (Note [replayable functions]), then run it as one
    graph, watching what goes on the wire; its record."""
    from .lazy import LazyTensor, spec_of

    if tr.nodes is not nodes or not nodes:
        raise _final(
            "it read a value, ran a backward pass or captured nothing"
            if nodes or tr.nodes is not nodes
            else "it captured no op"
        )
    ids = {id(n) for n in nodes}
    if any(n.rng is not None for n in nodes):
        raise _final("it draws random numbers")
    if any(n.failed is not None or n.executed or n.inflight is not None for n in nodes):
        raise _Miss("an op failed while it was captured")
    leaves, out_spec = pytree.tree_flatten(result)
    outs: list[tuple[Any, Any]] = []  # per leaf: ((node id, index), spec) or (None, value)
    for x in leaves:
        if isinstance(x, LazyTensor):
            ref = x._ref
            if not isinstance(ref, Pending) or id(ref.node) not in ids:
                raise _final("it returns a tensor it did not make")
            if x.requires_grad or x.grad_fn is not None:
                raise _final("it makes tensors with an autograd history")
            outs.append(((id(ref.node), ref.index), spec_of(x)))
        elif isinstance(x, torch.Tensor):
            raise _final("it returns a local tensor")
        elif x is None or type(x) in PLAIN:
            outs.append((None, x))
        else:  # an object may hold tensors of this call (a KV cache): a replay's would not
            raise _final(f"it returns a {type(x).__name__}, not a tensor or a plain value")
    returned = {o for o, _ in outs if o is not None}
    grad_cells = _grad_cells(reads, tensors)
    left: dict[tuple[int, int], list[Any]] = {}  # gradients in .grad, by output
    for n in nodes:
        for k in range(n.nout):
            if (id(n), k) in returned:
                continue
            for w in n.holders[k]:
                cell = w()
                if cell is None or not isinstance(cell.ref, Pending) or cell.ref.node is not n:
                    continue
                if id(cell) not in grad_cells:  # self.cache = x: a replay could not set it
                    # (not final: an optimizer's first step makes its state, later ones
                    # update it in place)
                    raise _Miss(f"it keeps a tensor it made that it does not return ({n.name})")
                left.setdefault((id(n), k), []).append(weakref.ref(cell))
    seen: dict[str, Any] = {}
    trace_mod._local.observer = lambda *graph: seen.setdefault("graph", graph)
    try:
        trace_mod.flush(tr)
    finally:
        trace_mod._local.observer = None
    graph = seen.get("graph")
    if graph is None:
        raise _Miss("its graph was not sent")
    encoded, keep, fetch, inline, targets = graph
    if fetch or len(keep) != len(targets):
        raise _Miss("its graph fetched or kept more than it returns")
    slot = {(id(n), k): j for j, (n, k, _alive) in enumerate(targets)}
    grads = [(slot[where], cells) for where, cells in left.items() if where in slot]
    if len(grads) != len(left):
        raise _Miss("a gradient was not kept")
    outputs: list[tuple[str, Any]] = []
    for where, what in outs:
        if where is None:
            outputs.append(("value", what))
        elif where in slot:
            outputs.append(("kept", (slot[where], _spec_key(what))))
        else:
            raise _Miss("an output was not kept")
    tpl, inputs, scalars = templates.template({"nodes": encoded, "keep": keep, "fetch": []})
    by_arg = {}
    for i, t in enumerate(tensors):
        ref = trace_mod.resolved(t._ref)
        if isinstance(ref, RemoteTensor):
            by_arg.setdefault(ref.handle, i)
    sources: list[tuple[str, Any]] = []
    for h in inputs:
        cell = reads[h][0] if h in reads else None
        if h in by_arg:
            sources.append(("arg", by_arg[h]))
        elif cell is not None and isinstance(cell.ref, RemoteTensor) and cell.ref.handle == h:
            sources.append(("held", weakref.ref(cell)))
        else:
            raise _Miss("an input's source is unknown")
    return _Record(
        fingerprint=templates.fingerprint(tpl),
        tpl=tpl,
        scalars=scalars,
        inline=[t.detach().clone() for t in inline],
        sources=sources,
        handles=list(inputs),
        outputs=outputs,
        out_spec=out_spec,
        grads=grads,
        ops=len(encoded),
    )


def _grad_cells(reads: dict[str, Any], tensors: list[Any]) -> set[int]:
    """The Bindings of the ``.grad`` of every tensor the call read or took: a gradient a
    backward pass left there is set again by a replay (Note [replayable functions])."""
    from .lazy import LazyTensor

    cells: set[int] = set()
    for t in [t for _cell, t in reads.values()] + tensors:
        grad = t._grad if isinstance(t, torch.Tensor) and t.is_leaf else None
        if isinstance(grad, LazyTensor):
            cells.add(id(grad.__dict__["_b"]))
    return cells


def _spec_key(spec: TensorSpec) -> tuple:
    return (spec.dtype, tuple(spec.shape), tuple(spec.stride), spec.offset)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))


# -- replaying ---------------------------------------------------------------------------
def _replay(rec: _Record, tensors: list[Any]) -> Any:
    from .lazy import LazyTensor
    from .session import default_session

    tr = trace_mod.current()
    if tr.nodes:
        trace_mod.flush(tr)  # the arguments' own ops run first
    else:
        trace_mod.land_all()
    session = default_session()
    grads = [[w() for w in cells] for _k, cells in rec.grads]
    if any(c is None or not isinstance(c.ref, RemoteTensor) for cs in grads for c in cs):
        raise _Miss("a gradient it left in .grad was replaced or dropped since")
    handles: list[str] = []
    for (kind, src), recorded in zip(rec.sources, rec.handles, strict=True):
        if kind == "arg":
            ref = trace_mod.resolved(tensors[src]._ref)
        else:
            cell = src()
            ref = None if cell is None else cell.ref
            if not isinstance(ref, RemoteTensor) or ref.handle != recorded:
                raise _Miss("a tensor it reads was replaced, written or dropped since")
        if not isinstance(ref, RemoteTensor) or ref.session is not session:
            raise _Miss("an input is not a remote tensor of this session")
        if ref.failed is not None:
            raise ref.failed
        handles.append(ref.handle)
    body = templates.instantiate(rec.tpl, handles, rec.scalars)
    form = (rec.fingerprint, handles, rec.scalars)
    kept, _ = session.execute(body["nodes"], keep=body["keep"], inline=rec.inline, form=form)
    for (k, _cells), cs in zip(rec.grads, grads, strict=True):
        for cell in cs:
            cell.ref = kept[k]  # the .grad the call leaves, as a run of fn would
            for i, (kind, src) in enumerate(rec.sources):
                if kind == "held" and src() is cell:  # read by the next call
                    rec.handles[i] = kept[k].handle
    leaves: list[Any] = []
    made: dict[tuple, Any] = {}  # an output returned twice is one tensor, as in eager
    for kind, what in rec.outputs:
        if kind == "value":
            leaves.append(what)
            continue
        k, (dtype, shape, stride, offset) = what
        if what not in made:
            made[what] = LazyTensor(TensorSpec(dtype, shape, stride, offset, None), kept[k])
        leaves.append(made[what])
    return pytree.tree_unflatten(leaves, rec.out_spec)
