"""Replayable functions: a call captured once, then run again by its graph template.

Note [replayable functions]: capture costs the client a Python ``__torch_dispatch__`` per
op, and that dispatch alone is most of it (``benchmarks/capture.py``: warm capture sits at
0.85-0.91x of a bare wrapper subclass that only builds its outputs, 27-33 µs per op on a
2-core host). No per-op guard can go under that floor, so a forward repeated with new
inputs cost the client as much as the first. ``djinn.replayable(fn)`` skips the ops
altogether, the way a CUDA graph replays its kernels: a call of ``fn`` is captured as one
graph and kept on the appliance as a template (Note [graph templates]); a later call with
arguments of the same kinds sends the template's fingerprint, its input handles and its
floats, and wraps the kept outputs in new LazyTensors, without waiting for the graph to
run (Note [asynchronous replays], replay_run.py). The client's cost no longer grows with
the op count, nor do the bytes on the wire.

The contract is a CUDA graph's: what ``fn`` computes must follow from its tensor
arguments and the remote tensors it reads (model weights, updated in place or not), with
its Python-side state as it was when recorded. What can be checked is checked, and a
call that fails a check simply runs ``fn`` as before (``stats()`` counts why):

- the *key* (replay_key.py): each argument's kind (a remote tensor's dtype, shape,
  strides, offset, ``requires_grad`` and inference flag; a plain value by value, a float
  by its bits; any other object by identity), which arguments are one tensor (one
  handle), grad and inference mode, autocast, and the session; a new key records again;
- the *state* the recording used, checked before every replay: each module whose
  forward ran or that was an argument (a method's ``self``): its train/eval flag, its
  forward and backward hooks, and which tensor objects bound to which values are its
  parameters and buffers, with their gradient hooks and ``requires_grad``; each
  optimizer that stepped: its hooks, parameters, state tensors (``load_state_dict``
  replaces them) and hyperparameters (a scheduler's learning rate; a CPU tensor one by
  its values); the remote tensors ``fn`` names in its closure or globals; PyTorch's
  global module and optimizer hooks; and whether each ``.grad`` a replay sets was empty
  when the recording began (else a run would add to it); a change records again;
- a recording is replayable only if ``fn`` read no value (a ``.item()`` or ``.cpu()`` can
  steer Python), drew no random numbers (a replay would repeat them), made no tensor with
  an autograd history (a replay builds none), captured every op in one graph (its own
  and its backward pass's), returned only tensors it made (and plain values), and left
  no other tensor it made alive but gradients in ``.grad`` (``self.cache = x``: a replay
  could not set it);
- a key replays only after ``after`` recordings in a row gave the same graph, the same
  floats and inline tensors, the same inputs and the same outputs: a float that changes
  from call to call (an optimizer's bias correction) is Python state a replay would
  freeze, so that key keeps recording, and after ``MAX_UNLIKE`` recordings in a row
  unlike the one before runs as it is for ``PAUSE_CALLS`` calls before it records again
  (a recording waits for its graph, where a plain call lets the worker run it while the
  client captures on; a learning-rate warm-up ends); a key whose replays keep finding
  what they are checked by changed pauses too (Note [state that changes at every
  call]);
- each input a replay reads besides the arguments (a weight) must still be what every
  tensor that held it at recording holds: the same binding (Note [bindings]) bound to the
  same handle. A tensor replaced (``p.data = ...``) or dropped makes the key record
  again; one written in place is read as it is now. A gradient it reads is read from
  ``.grad`` as it is now. An argument that is also a tensor it reads by name (a weight
  passed in) is not replayed;
- a small CPU tensor it reads (sent inline) must still hold the bytes it held.

A training step replays too: its backward pass, which PyTorch runs on its device thread
while ``fn`` waits, joins the recording's graph, and each replay puts new gradient
tensors in ``.grad`` of the tensors that got them, as a run of ``fn`` would (a gradient
kept from an earlier step keeps its value). A replay's in-place writes count in the
version counters of the tensors it writes, as eager's do, so autograd still refuses a
saved tensor written since.

Note [optimizer steps run, not replayed] (replay_steps.py): a call that ends with optimizer
steps whose floats or counts change from call to call replays the ops before them, and
runs the steps; Note [followed steps] (replay_follow.py): when only their floats change,
the steps are run against the whole recording's, and the whole call goes as one graph.

What cannot be checked is other Python state ``fn`` reads that changes later while every
tensor stays the same (a flag on an object it does not name, a float a hook reads): a
replay uses the recorded value, as a CUDA graph does. Nor does a replay run ``fn``'s own
Python (but, where their floats change, the optimizer steps that end it): a scheduler
stepped or a counter incremented inside ``fn`` is not, so keep those outside. A call
replayed whole runs no optimizer ``step()`` either: one overridden to branch on a flag of
its own (set between calls, not a hyperparameter) is frozen with the rest.
``reset()`` forgets every recording.

A replay runs every op the recorded call ran, in order, with every check of the
appliance (the template is instantiated there exactly as if sent whole), so its results
are the bits a capture of the same call would give.
"""

from __future__ import annotations

import gc
import threading
import types
import weakref
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from djinn.protocol import templates
from djinn.runtime.graph_forms import worth_a_template
from djinn.runtime.remote import RemoteTensor

from . import extension_points, replay_follow
from . import trace as trace_mod
from .failures import written_values
from .nodes import Pending
from .replay_key import PLAIN, Miss, State, Used, Watch, key, named_tensors
from .replay_run import replay, same_bytes
from .replay_sources import grad_owners, left_in_grad, sources_of, spec_key
from .replay_steps import (
    grads_as_at_steps,
    grads_left,
    optimizer_cut,
    outer_steps,
    own_inline,
    steps_find_their_gradients,
    steps_read_gradients,
)

MAX_KEYS = 16  # recordings kept per function, the least recently used let go
# recordings in a row unlike the one before after which a key stops recording: its graph
# or floats change every call (the default Adam's bias corrections), and a recording
# costs a call its overlap (it waits for its graph)
MAX_UNLIKE = 4
PAUSE_CALLS = 16  # calls run as they are before such a key records again (a warm-up ended)
# Note [state that changes at every call]: a key whose replays keep finding the state it
# is checked by changed (a learning rate a scheduler sets at every step, outside ``fn``)
# recorded at every call: 30 Adam steps with a LambdaLR took 582 ms replayable against 393
# ms plain, with no replay. After MAX_MISSES such replays in a row it runs as it is for a
# pause that doubles each time, up to MAX_PAUSE calls; a replay that succeeds starts over.
# A replay that finds its state changed records, and the recording is compared with the
# one before as any is (it replays from the next call when they match).
MAX_MISSES = 2
MAX_PAUSE = 256


@dataclass
class _Record:
    """One recorded call: the graph's template and what fills it in."""

    fingerprint: str
    tpl: dict[str, Any]
    scalars: list[float]
    inline: list[torch.Tensor]
    external: list[tuple[Any, torch.Tensor]]  # CPU tensors it read (weakref, bytes then)
    # per input: ("arg", i), ("held", [weakrefs to Bindings]) or ("grad", tensor)
    sources: list[tuple[str, Any]]
    handles: list[str]  # the input handles as recorded
    written: list[tuple[str, Any]]  # what its in-place ops write: ("arg", i) or a tensor
    outputs: list[tuple[str, Any]]  # per result leaf: ("kept", (k, spec)) or ("value", v)
    out_spec: Any
    grads: list[tuple[int, torch.Tensor, tuple]]  # (kept slot, tensor, spec) per .grad
    state: State
    # per gradient: whether its .grad was None when the call began (known from the second
    # recording of a key on: the first one's owners are known only once it has run)
    empty: list[bool | None] = field(default_factory=list)
    # the optimizers whose steps end the call, run after the replayed graph (Note
    # [optimizer steps run, not replayed]); empty: the graph is the whole call
    steps: list[Any] = field(default_factory=list)
    # where the parameters are (replay_key.param_at) whose .grad the call set to None,
    # and those it found and left None: a replay clears the first, and must find the
    # second None (Watch)
    clears: list[Any] = field(default_factory=list)
    nones: list[Any] = field(default_factory=list)
    split: _Record | None = None  # the record of its ops before its optimizer steps
    # Note [followed steps] (replay_follow.py): a split record's whole recording, the plan
    # of its steps' ops to follow into it (set once two wholes were alike but for their
    # floats), and that plan before it was
    whole: _Record | None = field(default=None, repr=False, compare=False)
    plan: Any = field(default=None, repr=False, compare=False)
    steps_plan: Any = field(default=None, repr=False, compare=False)
    frozen: bool = False  # the call changed state it is checked by: it cannot replay
    unwatched: bool = False  # it made gradients or stepped, and had no recording before
    fill: Any = field(default=None, repr=False, compare=False)  # templates.instantiator
    same: int = 1  # recordings in a row that gave this record
    unlike: int = 0  # recordings in a row unlike the one before

    def matches(self, other: _Record) -> bool:
        return self.scalars == other.scalars and self.alike(other)

    def alike(self, other: _Record) -> bool:
        """The same but for the floats: the same template, inputs and outputs."""
        return (
            self.fingerprint == other.fingerprint
            and len(self.scalars) == len(other.scalars)
            and self._shape() == other._shape()
            and self.outputs == other.outputs
            and self.out_spec == other.out_spec
            and len(self.inline) == len(other.inline)
            and all(same_bytes(a, b) for a, b in zip(self.inline, other.inline, strict=True))
        )

    def _shape(self) -> list[Any]:
        """Where each input and each gradient come from, a held input named by its handle."""
        where = [
            (kind, src if kind == "arg" else id(src) if kind == "grad" else h)
            for (kind, src), h in zip(self.sources, self.handles, strict=True)
        ]
        return [*where, *((k, id(t)) for k, t, _ in self.grads)]


@dataclass
class _Stats:
    calls: int = 0
    replays: int = 0
    recordings: int = 0
    plain: Counter = field(default_factory=Counter)  # calls run as they are, by reason
    # Note [followed steps]: replays whose steps were followed into one request, and
    # those whose steps were captured after all, by reason
    followed: int = 0
    captured: Counter = field(default_factory=Counter)


class Replayable:
    """``fn`` made replayable (Note [replayable functions]); see ``djinn.replayable``."""

    def __init__(self, fn: Callable[..., Any], *, after: int = 2) -> None:
        if not callable(fn):
            raise TypeError(f"replayable() takes a function, got {type(fn).__name__}")
        if type(after) is not int or after < 1:
            raise ValueError("after must be an integer of at least 1")
        self.fn = fn
        self.after = after
        # a record; a reason it never replays; or (a reason, the call it may record again at)
        self._records: OrderedDict[Any, _Record | str | tuple] = OrderedDict()
        self._stats = _Stats()
        self._lock = threading.RLock()  # one call records or replays at a time
        # per key: [replays in a row that found its state changed, the next pause's calls]
        self._misses: dict[Any, list[int]] = {}
        self.__wrapped__ = fn
        self._label = getattr(fn, "__qualname__", None) or type(fn).__name__
        self.__doc__ = getattr(fn, "__doc__", None)

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        """``@djinn.replayable`` on a method: bound to its instance (an argument, keyed
        by identity)."""
        return self if obj is None else types.MethodType(self, obj)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            self._stats.calls += 1
            try:
                k, tensors = key(args, kwargs)
            except Miss as why:
                self._stats.plain[str(why)] += 1
                return self.fn(*args, **kwargs)
            rec = self._records.get(k)
            if rec is not None:
                self._records.move_to_end(k)
            if isinstance(rec, tuple):  # unlike recordings: a pause (MAX_UNLIKE)
                why, until = rec
                if self._stats.calls < until:
                    self._stats.plain[why] += 1
                    return self.fn(*args, **kwargs)
                del self._records[k]
                rec = None
            if isinstance(rec, str):  # this key can never replay: say why once more
                self._stats.plain[rec] += 1
                return self.fn(*args, **kwargs)
            if rec is not None and rec.same >= self.after and not rec.unwatched:
                try:
                    out = replay(rec, tensors, self._label, self._stats)
                except Miss as why:
                    self._stats.plain[str(why)] += 1
                    if rec.state.now() is None or any(w() is None for w in rec.steps):
                        # a module or optimizer it was checked by is gone: the record
                        # cannot watch what the next call does to the new ones (found by
                        # review: a scheduler stepped inside fn with a new optimizer was
                        # frozen), so record afresh, as a first recording
                        del self._records[k]
                        self._misses.pop(k, None)
                    elif self._missed(k):  # Note [state that changes at every call]
                        return self.fn(*args, **kwargs)
                    # else recorded again: one like this record replays from the next call
                else:
                    self._stats.replays += 1
                    self._misses.pop(k, None)
                    return out
            return self._record(k, args, kwargs, tensors)

    def _missed(self, k: Any) -> bool:
        """A replay of ``k`` found what it is checked by changed; whether ``k`` now pauses
        (Note [state that changes at every call])."""
        missed = self._misses.setdefault(k, [0, PAUSE_CALLS])
        missed[0] += 1
        if missed[0] < MAX_MISSES:
            return False
        pause, missed[:] = missed[1], [0, min(2 * missed[1], MAX_PAUSE)]
        why = "what it is checked by changes between calls (a scheduler's learning rate)"
        self._keep(k, (why, self._stats.calls + pause))
        return True

    def reset(self) -> None:
        """Forget every recording: the next calls record again (after a change to Python
        state the function reads that no check sees)."""
        with self._lock:
            self._records.clear()
            self._misses.clear()

    def stats(self) -> dict[str, Any]:
        """Calls, replays, recordings, and the calls run as they are by reason; replays
        whose optimizer steps were followed into one request, and those whose steps were
        captured after all by reason (Note [followed steps])."""
        s = self._stats
        return {
            "calls": s.calls,
            "replays": s.replays,
            "recordings": s.recordings,
            "plain": dict(s.plain),
            "keys": len(self._records),
            "steps_followed": s.followed,
            "steps_captured": dict(s.captured),
        }

    def _record(self, k: Any, args: tuple, kwargs: dict, tensors: list[Any]) -> Any:
        prev = self._records.get(k)
        # whether each gradient a previous recording left was None as this call begins
        empty = (
            {id(t): t._grad is None for _k, t, _spec in prev.grads}
            if isinstance(prev, _Record)
            else {}
        )
        tr = trace_mod.current()
        trace_mod.flush(tr)  # what came before runs first: the graph holds fn's ops only
        nodes = tr.nodes
        chunk, tr.chunk_ops = tr.chunk_ops, 0  # one graph (Note [streamed graphs])
        reads: dict[Any, list[tuple[Any, Any]]] = {}
        tr.reads = reads
        outer, trace_mod.RECORDING = trace_mod.RECORDING, (threading.get_ident(), tr)
        used = Used(lambda: len(tr.nodes))
        if isinstance(prev, _Record):  # what the call changes shows against it
            split = prev.split.state if prev.split is not None else None
            used.watch = Watch(None, prev.state) if prev.steps else Watch(prev.state, split)
        for x in pytree.tree_leaves((args, kwargs)):  # a module given (a method's self)
            if isinstance(x, torch.nn.Module):
                for m in x.modules():
                    used.module_ran(m)
        try:
            with extension_points.watching(used):
                result = self.fn(*args, **kwargs)
        finally:
            trace_mod.RECORDING = outer
            tr.chunk_ops = chunk
            tr.reads = None
        try:
            closure = named_tensors(self.fn)
            rec = _recorded(tr, nodes, result, tensors, reads, used, closure)
        except Miss as why:
            self._stats.plain[str(why)] += 1
            if why.final:
                self._keep(k, str(why))
            return result
        self._stats.recordings += 1
        old = self._records.get(k)
        split = rec.split
        if isinstance(old, _Record) and old.steps:  # its steps run at every call
            if split is not None and old.matches(split):
                split.same = old.same + 1
                _follow(split, old.whole)
                self._store(k, split, empty)
                return result
            old = None  # it no longer ends with the same steps: start again
        if split is not None and rec.frozen:  # a replay of the whole would freeze a count
            if isinstance(old, _Record) and old.split is not None and old.split.matches(split):
                split.same = old.split.same + 1
            self._store(k, split, empty)
            return result
        if isinstance(old, _Record) and split is not None and old.split is not None:
            if old.split.matches(split):
                split.same = old.split.same + 1
            if not old.matches(rec) and split.same > 1:
                # the whole call's floats change from call to call, the ops before its
                # steps do not (Note [optimizer steps run, not replayed])
                _follow(split, old)
                self._store(k, split, empty)
                return result
        if rec.frozen:  # a replay would not make the change the call made
            rec.same = 0
            rec.unlike = (old.unlike if isinstance(old, _Record) else 0) + 1
            if rec.unlike >= MAX_UNLIKE:
                why = "it changes state it is checked by (a count, a scheduler in it)"
                self._keep(k, (why, self._stats.calls + PAUSE_CALLS))
                return result
        elif isinstance(old, _Record) and old.matches(rec):
            rec.same = old.same + 1
        elif isinstance(old, _Record):
            rec.unlike = old.unlike + 1
            if rec.unlike >= MAX_UNLIKE:
                why = "its graph, floats or inputs change from call to call"
                self._keep(k, (why, self._stats.calls + PAUSE_CALLS))
                return result
        self._store(k, rec, empty)
        return result

    def _store(self, k: Any, rec: _Record, empty: dict[int, bool]) -> None:
        """Keep a recording, with whether each gradient it sets was None as it began."""
        rec.empty = [empty.get(id(t)) for _k, t, _spec in rec.grads]
        self._keep(k, rec)

    def _keep(self, k: Any, rec: _Record | str | tuple) -> None:
        self._records[k] = rec
        self._records.move_to_end(k)
        while len(self._records) > MAX_KEYS:
            self._misses.pop(self._records.popitem(last=False)[0], None)


def _follow(split: _Record, before: _Record | None) -> None:
    """Let replays of ``split`` follow its steps into its whole recording (Note [followed
    steps]) when ``before``, the whole recording before it, was alike but for its
    floats."""
    whole = split.whole
    if whole is None or before is None or not whole.alike(before):
        split.plan = None
        return
    split.plan = replay_follow.with_slots(split.steps_plan, whole, split)


def replayable(fn: Callable[..., Any] | None = None, *, after: int = 2) -> Any:
    """Make ``fn`` replayable (Note [replayable functions]): calls after the first
    ``after`` identical recordings send the recorded graph by fingerprint instead of
    capturing every op. Usable as ``@djinn.replayable`` or ``djinn.replayable(after=3)``."""
    if fn is None:
        return lambda f: Replayable(f, after=after)
    return Replayable(fn, after=after)


# -- recording ---------------------------------------------------------------------------
def _recorded(
    tr: Any,
    nodes: list[Any],
    result: Any,
    tensors: list[Any],
    reads: dict[Any, list[tuple[Any, Any]]],
    used: Used,
    closure: list[Any],
) -> _Record:
    """Check the call just captured (Note [replayable functions]), then run it as one
    graph, watching what goes on the wire; its record. When it ends with optimizer steps
    that could run at every call, ``split`` is the record of the ops before them (Note
    [optimizer steps run, not replayed])."""
    from .lazy import LazyTensor, spec_of

    cpu = [entries[0][1] for k, entries in list(reads.items()) if isinstance(k, tuple)]
    for k in [k for k in reads if isinstance(k, tuple)]:
        del reads[k]
    local = [(weakref.ref(t), t.detach().clone()) for t in cpu]
    del cpu  # what fn made itself dies with it; what outlives it is state it reads
    if tr.nodes is not nodes or not nodes:
        raise Miss(
            "it read a value or captured nothing" if tr.nodes is not nodes else "it captured no op",
            final=True,
        )
    ids = {id(n) for n in nodes}
    if any(n.rng is not None for n in nodes):
        raise Miss("it draws random numbers", final=True)
    if any(n.failed is not None or n.executed or n.inflight is not None for n in nodes):
        raise Miss("an op failed while it was captured")
    readers = [t for entries in reads.values() for _cell, t in entries]
    if torch.is_grad_enabled() and any(t.grad_fn is not None for t in readers + tensors):
        raise Miss("it writes an autograd history into a tensor it reads", final=True)
    state = State(used, closure)
    named = state.tensors()
    if any(id(t) in named for t in tensors):
        raise Miss("an argument is also a tensor it reads by name")
    leaves, out_spec = pytree.tree_flatten(result)
    outs: list[tuple[Any, Any]] = []  # per leaf: ((node id, index), spec) or (None, value)
    for x in leaves:
        if isinstance(x, LazyTensor):
            ref = x._ref
            if not isinstance(ref, Pending) or id(ref.node) not in ids:
                raise Miss("it returns a tensor it did not make", final=True)
            if x.requires_grad or x.grad_fn is not None:
                raise Miss("it makes tensors with an autograd history", final=True)
            outs.append(((id(ref.node), ref.index), spec_of(x)))
        elif isinstance(x, torch.Tensor):
            raise Miss("it returns a local tensor", final=True)
        elif x is None or type(x) in PLAIN:
            outs.append((None, x))
        else:  # an object may hold tensors of this call (a KV cache): a replay's would not
            raise Miss(f"it returns a {type(x).__name__}, not a tensor or a plain value", True)
    owners = grad_owners(readers + tensors)
    returned = {o for o, _ in outs if o is not None}
    try:
        left = left_in_grad(nodes, returned, owners)
    except Miss:
        left = None  # looked at again outside this block: its traceback holds the tensor
    if left is None:
        # Note [garbage that holds a tensor]: a reference cycle can hold a tensor the call
        # made and dropped until the collector runs (on an op's first capture, frames of
        # PyTorch's addmm decomposition on meta tensors stayed in one, and through the
        # capture's frames held F.linear's arguments). The call does not keep it: collect
        # the young generations once (cheap) and look again.
        gc.collect(1)
        left = left_in_grad(nodes, returned, owners)
    steps = outer_steps(used.steps)
    cut = optimizer_cut(len(nodes), steps)
    before = set() if cut is None else {id(n) for n in nodes[:cut]}
    if cut is not None and not (
        steps_read_gradients(nodes, cut, before, owners)
        and steps_find_their_gradients(steps, before, left)
        and all(where[0] in before for where, _spec in outs if where is not None)
    ):
        cut = None  # a replay could not give the steps what they read, or it returns theirs
    if cut is not None and not grads_as_at_steps(steps):
        cut = None  # a .grad changed during or after the steps: a replay sets them before
    watch = used.watch
    if cut is not None and watch is not None and watch.changed_outside_steps():
        cut = None  # it changed state it is checked by (a learning rate, a scheduler)
    frozen = used.frozen() or (watch is not None and watch.changed())
    # a call that writes (an update by hand), made gradients or stepped: its .grad and
    # state bookkeeping counts, and it replays only from a compared recording
    written = [_written(nodes), _written(nodes[:cut]) if cut is not None else set()]
    effects = bool(left or used.steps or written[0])
    clears, nones = grads_left(watch, left, effects)
    seen: dict[str, Any] = {}

    def observe(*graph: Any) -> tuple[str, list[str], list[float]] | None:
        """The graph the flush sends, and its template, worked out once for the wire and
        for the record. Only the first graph is the record's (a partial failure flushes
        the nodes that did not depend on it again); a graph too small to go by template
        goes whole, as any flush's."""
        if "graph" in seen:
            return None
        seen["graph"] = graph
        encoded, keep, fetch = graph[:3]
        tpl, inputs, scalars = templates.template({"nodes": encoded, "keep": keep,
                                                   "fetch": fetch})  # fmt: skip
        seen["form"] = (tpl, inputs, scalars)
        if not worth_a_template(encoded):
            return None
        return templates.fingerprint(tpl), inputs, scalars

    trace_mod._local.observer = observe
    try:
        trace_mod.flush(tr)
    finally:
        trace_mod._local.observer = None
    graph = seen.pop("graph", None)
    if graph is None:
        raise Miss("its graph was not sent")
    encoded, keep, fetch, inline, targets = graph
    del graph
    if fetch or len(keep) != len(targets):
        raise Miss("its graph fetched or kept more than it returns")
    parts = (outs, out_spec, tensors, reads, owners)
    external = [(w, bytes_) for w, bytes_ in local if w() is not None]
    rec = _record_of(encoded, keep, targets, inline, left, written[0], parts, state, external,
                     seen["form"])  # fmt: skip
    rec.clears, rec.nones, rec.frozen = clears, nones, frozen
    # what it does to .grad and to state shows only against the recording before it
    rec.unwatched = watch is None and effects
    if cut is not None and len(encoded) == len(nodes):
        steps_plan = replay_follow.plan_of(nodes, cut, rec.tpl)
        mine = [id(n) in before for n, _k, _alive in targets]
        keep = [ref for ref, m in zip(keep, mine, strict=True) if m]
        targets = [t for t, m in zip(targets, mine, strict=True) if m]
        encoded, inline = own_inline(encoded[:cut], inline)
        left = {where: v for where, v in left.items() if where[0] in before}
        state = State(used, closure, kept=False)  # they run at every call
        try:
            rec.split = _record_of(encoded, keep, targets, inline, left, written[1], parts,
                                   state, external)  # fmt: skip
        except Miss:  # the whole call may still replay
            return rec
        rec.split.steps = [weakref.ref(step.opt) for step in steps]
        rec.split.whole, rec.split.steps_plan = rec, steps_plan
        rec.split.clears, rec.split.nones = clears, nones
        rec.split.unwatched = rec.unwatched
    return rec


def _written(nodes: list[Any]) -> set[str]:
    """The handles ``nodes`` write into."""
    return {v.handle for n in nodes for v in written_values(n.op, n.args, n.kwargs)
            if isinstance(v, RemoteTensor)}  # fmt: skip


def _record_of(
    encoded: list[Any],
    keep: list[Any],
    targets: list[Any],
    inline: list[Any],
    left: dict,
    written: set[str],
    parts: tuple,
    state: State,
    external: list[tuple[Any, torch.Tensor]],
    form: tuple[dict[str, Any], list[str], list[float]] | None = None,
) -> _Record:
    """The record of a graph the call sent (or of its ops before its optimizer steps);
    ``form``: its template, inputs and scalars when already worked out."""
    outs, out_spec, tensors, reads, owners = parts
    slot = {(id(n), k): j for j, (n, k, _alive) in enumerate(targets)}
    if any(where not in slot for where in left):
        raise Miss("a gradient was not kept")
    grads = [(slot[where], t, spec) for where, (t, spec) in left.items()]
    outputs: list[tuple[str, Any]] = []
    for where, what in outs:
        if where is None:
            outputs.append(("value", what))
        elif where in slot:
            outputs.append(("kept", (slot[where], spec_key(what))))
        else:
            raise Miss("an output was not kept")
    if form is None:
        form = templates.template({"nodes": encoded, "keep": keep, "fetch": []})
    tpl, inputs, scalars = form
    sources, changed = sources_of(inputs, tensors, reads, owners, written)
    return _Record(
        fingerprint=templates.fingerprint(tpl),
        tpl=tpl,
        scalars=scalars,
        inline=[t.detach().clone() for t in inline],
        external=external,
        sources=sources,
        handles=list(inputs),
        written=changed,
        outputs=outputs,
        out_spec=out_spec,
        grads=grads,
        state=state,
    )
