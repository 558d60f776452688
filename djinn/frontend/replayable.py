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
  steer Python) but those the client computes from its arguments (an attention mask's
  ``.all()``), which each replay checks again (Note [values the client knows] in
  known.py; a key keeps a recording per set of such values), drew no random numbers as
  many as its inputs' values say (a Poisson sampler; dropout and ``randn`` replay, each
  replay drawing anew from the local generator: Note [replayed draws]) and used that
  generator no other way (a seed, a local draw), made no tensor with an autograd history
  (a replay builds none), captured every op in one graph (its own and its backward pass's),
  returned only tensors it made, views of them, and plain values, and left no other
  tensor it made alive but gradients in ``.grad`` (``self.cache = x``: a replay could
  not set it; a base only its returned views hold is theirs);
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

import threading
import types
import weakref
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from . import extension_points, known, own_generators, replay_follow, seeded
from . import trace as trace_mod
from .replay_key import Miss, Used, Watch, key, named_tensors
from .replay_record import Record, guarded, recorded
from .replay_run import flush_arguments, replay

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
# Note [values the client knows] (known.py): sets of values read a key records besides its
# first; a read whose value changes at every call (a count of padded tokens) then runs as
# it is rather than recording at every call (a review: 2x a plain call's time)
MAX_READ_SETS = 3
VARIED = "the values it reads change from call to call"
MAX_PAUSE = 256


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

    def __init__(self, fn: Callable[..., Any], *, after: int = 2, follow: bool = True) -> None:
        if not callable(fn):
            raise TypeError(f"replayable() takes a function, got {type(fn).__name__}")
        if type(after) is not int or after < 1:
            raise ValueError("after must be an integer of at least 1")
        if type(follow) is not bool:
            raise TypeError("follow must be True or False")
        self.fn = fn
        self.after = after
        self.follow = follow  # Note [followed steps]
        # a record; a reason it never replays; or (a reason, the call it may record again at)
        self._records: OrderedDict[Any, Record | str | tuple] = OrderedDict()
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
            checked = False  # its guards found true on these arguments (_by_reads)
            if isinstance(rec, Record) and rec.guards:
                k, rec, checked = self._by_reads(k, rec, tensors)
                if rec is VARIED:
                    self._stats.plain[VARIED] += 1
                    return self.fn(*args, **kwargs)
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
                    out = replay(rec, tensors, self._label, self._stats, checked=checked)
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

    def _by_reads(self, k: Any, rec: Record, tensors: list[Any]) -> tuple[Any, Any, bool]:
        """Note [values the client knows] (known.py): a key whose recording read values
        the client computed keeps a recording per set of values read (a batch with
        padding, one without), each under the key and those values; the first under the
        key alone. The key and recording for ``tensors``, and whether its guards were
        found true (a replay need not run them again)."""
        tr = trace_mod.current()
        if tr.nodes:
            flush_arguments(tr, tensors)
        now = known.read_now(rec.guards, tensors, tr)
        if now == [g.value for g in rec.guards]:
            return k, rec, True
        sub = (k, "read", tuple(now))
        got = self._records.get(sub)
        if got is None:
            if sub not in rec.read_sets and len(rec.read_sets) >= MAX_READ_SETS:
                return sub, VARIED, False
            rec.read_sets.add(sub)
        return sub, got, False

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
            if isinstance(prev, Record)
            else {}
        )
        tr = trace_mod.current()
        flush_arguments(tr, tensors)  # what came before runs first: the graph holds fn's only
        with tr.lock:  # until its graph is sent (Note [writes another thread captured])
            tr.recording += 1
        try:
            return self._record_on(tr, k, args, kwargs, tensors, prev, empty)
        finally:
            with tr.lock:
                tr.recording -= 1

    def _record_on(
        self, tr: Any, k: Any, args: tuple, kwargs: dict, tensors: list[Any], prev: Any, empty: dict
    ) -> Any:
        """``_record`` on ``tr``, the thread's trace, flushed and marked recording."""
        nodes = tr.nodes
        chunk, tr.chunk_ops = tr.chunk_ops, 0  # one graph (Note [streamed graphs])
        reads: dict[Any, list[tuple[Any, Any]]] = {}
        tr.reads = reads
        guards: list[Any] = []  # Note [values the client knows] (known.py)
        tr.guards = guards
        outer, trace_mod.RECORDING = trace_mod.RECORDING, (threading.get_ident(), tr)
        used = Used(lambda: len(tr.nodes))
        if isinstance(prev, Record):  # what the call changes shows against it
            split = prev.split.state if prev.split is not None else None
            used.watch = Watch(None, prev.state) if prev.steps else Watch(prev.state, split)
        for x in pytree.tree_leaves((args, kwargs)):  # a module given (a method's self)
            if isinstance(x, torch.nn.Module):
                for m in x.modules():
                    used.module_ran(m)
        entry = seeded.generators()  # Note [replayed draws]: what the call does with them
        own = own_generators.OwnGenerators()  # Note [explicit generators]
        try:
            with extension_points.watching(used), used.stepping_watched(self.fn), own:
                result = self.fn(*args, **kwargs)
        finally:
            trace_mod.RECORDING = outer
            tr.chunk_ops = chunk
            tr.reads = None
            tr.guards = None
        try:
            if own.seen:  # a draw of its own the replay would not make, local or remote
                raise Miss("it draws from a generator of its own (generator=)", final=True)
            closure = named_tensors(self.fn)
            generator = (entry, seeded.generators())
            rec = recorded(tr, nodes, result, tensors, reads, used, closure, generator)
            rec.guards = guarded(guards, tensors)
            if rec.split is not None:
                rec.split.guards = rec.guards
        except Miss as why:
            self._stats.plain[str(why)] += 1
            if why.final:
                self._keep(k, str(why))
            return result
        self._stats.recordings += 1
        old = self._records.get(k)
        split = rec.split
        if isinstance(old, Record) and old.steps:  # its steps run at every call
            if split is not None and old.matches(split):
                split.same = old.same + 1
                _follow(split, on=self.follow)
                self._store(k, split, empty)
                return result
            old = None  # it no longer ends with the same steps: start again
        if split is not None and rec.frozen:  # a replay of the whole would freeze a count
            if isinstance(old, Record) and old.split is not None and old.split.matches(split):
                split.same = old.split.same + 1
            _follow(split, on=False)
            self._store(k, split, empty)
            return result
        if isinstance(old, Record) and split is not None and old.split is not None:
            if old.split.matches(split):
                split.same = old.split.same + 1
            if not old.matches(rec) and split.same > 1:
                # the whole call's floats change from call to call, the ops before its
                # steps do not (Note [optimizer steps run, not replayed])
                _follow(split, on=self.follow)
                self._store(k, split, empty)
                return result
        if rec.frozen:  # a replay would not make the change the call made
            rec.same = 0
            rec.unlike = (old.unlike if isinstance(old, Record) else 0) + 1
            if rec.unlike >= MAX_UNLIKE:
                why = "it changes state it is checked by (a count, a scheduler in it)"
                self._keep(k, (why, self._stats.calls + PAUSE_CALLS))
                return result
        elif isinstance(old, Record) and old.matches(rec):
            rec.same = old.same + 1
        elif isinstance(old, Record):
            rec.unlike = old.unlike + 1
            if rec.unlike >= MAX_UNLIKE:
                why = "its graph, floats or inputs change from call to call"
                self._keep(k, (why, self._stats.calls + PAUSE_CALLS))
                return result
        self._store(k, rec, empty)
        return result

    def _store(self, k: Any, rec: Record, empty: dict[int, bool]) -> None:
        """Keep a recording, with whether each gradient it sets was None as it began."""
        rec.empty = [empty.get(id(t)) for _k, t, _spec in rec.grads]
        old = self._records.get(k)
        if isinstance(old, Record):  # recorded again: the other values it read still count
            rec.read_sets = old.read_sets
        self._keep(k, rec)

    def _keep(self, k: Any, rec: Record | str | tuple) -> None:
        self._records[k] = rec
        self._records.move_to_end(k)
        while len(self._records) > MAX_KEYS:
            self._misses.pop(self._records.popitem(last=False)[0], None)


def _follow(split: Record, on: bool = True) -> None:
    """Let replays of ``split`` follow its steps into its whole recording (Note [followed
    steps]) when they can, else let that recording go. The whole recording holds what its
    steps write weakly: the optimizer state it names is freed when the program replaces
    it (a review found a ``load_state_dict`` leaving a copy of Adam's state on the
    appliance for as long as the key lived)."""
    whole = split.whole
    plan = replay_follow.with_slots(split.steps_plan, whole, split) if on and whole else None
    split.steps_plan = None
    if plan is None:
        split.whole = split.plan = None
        return
    whole.split = None
    whole.written = [(kind, weakref.ref(what) if kind == "tensor" else what)
                     for kind, what in whole.written]  # fmt: skip
    split.plan = plan


def replayable(fn: Callable[..., Any] | None = None, *, after: int = 2, follow: bool = True) -> Any:
    """Make ``fn`` replayable (Note [replayable functions]): calls after the first
    ``after`` identical recordings send the recorded graph by fingerprint instead of
    capturing every op. Usable as ``@djinn.replayable`` or ``djinn.replayable(after=3)``.
    ``follow=False``: optimizer steps whose floats change at every call (the default
    Adam's) are captured at every replay, not followed into one request (Note [followed
    steps]): the same results, a request and a capture more per call."""
    if fn is None:
        return lambda f: Replayable(f, after=after, follow=follow)
    return Replayable(fn, after=after, follow=follow)
