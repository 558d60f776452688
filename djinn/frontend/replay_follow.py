"""Optimizer steps followed, not captured: a replay of a whole training call whose step
floats change from call to call.

Note [followed steps]: the default ``Adam``'s step computes its bias corrections as Python
floats from a step count it keeps on the CPU, so a call ending with it never records alike
as a whole, and its replay sent the ops before the steps, then ran the steps, capturing
each op (Note [optimizer steps run, not replayed], replay_steps.py). That capture, its
encoding and its second request cost the client more than the replay itself: a replayed
default-Adam step took 1.6-1.9x as long as the same step with SGD, whose step replays
whole (a 2-core host, 2026-11-27).

When such a call's recordings split, the key keeps the last whole recording too, with a
plan of its steps' ops: per op, the aten function, and per argument where its value comes
from (an
input of the template, a gradient the graph keeps, an earlier step op's output), a float
(one of the template's scalars), or a plain value. A replay then runs the steps as ``fn``
would, with a ``Follower`` on the thread's trace: each op they dispatch is checked against
the plan, leaf by leaf (the same function, the same tensors by where they come from, the
same plain values, a finite float where a float was); its floats are taken as this call's
scalars, and it returns what the capture would have (the tensors it writes into; new
tensors with the recorded metadata, which nothing can read). When every op was followed
and no tensor the steps made outlives them, the steps go as a replay with the new floats:
no op is captured, no graph is encoded. Two ways (Note [steps followed while the graph
runs], replay_followed.py): the split replay sent as the call starts and then the steps'
own graph (``steps_graph``: the whole template's nodes from the cut on, reading the
gradients the split keeps as inputs), or the whole template once the steps were followed.

Anything else stops the following, and loses nothing: the ops before the cut are sent as
the split replay they would have been, if they were not (their outputs and gradients
rebound to it), the ops followed so far are captured as they were called, the tensors
they made are bound to what the capture made, and the steps go on captured. That happens
on the first op that differs from the plan, a special op (a read, a detach), a node
captured by any other way, a flush of the trace, an error raised in a step, or a tensor
the steps made still alive after them. If a split replay sent first fails, the steps are
not sent, and what they write holds its error (Note [failed values]).
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from djinn.protocol import templates
from djinn.protocol.values import encode_constant
from djinn.runtime.remote import RemoteTensor

from . import trace as trace_mod
from . import writes
from .failures import written_values
from .lazy import LazyTensor, capture
from .meta import TensorSpec
from .nodes import Node, Pending


class _NoPlan(Exception):
    """The steps cannot be followed (an inline tensor, a non-finite float...)."""


@dataclass
class _Op:
    func: Any
    leaves: list[tuple]  # what each leaf of its arguments is, in walk order
    kwargs: tuple[str, ...]
    specs: Any  # the captured node's output specs (None: it returns nothing)
    multi: bool
    new: dict[int, int]  # output index -> its place among the new tensors it makes
    # the positions of the arguments holding an earlier step op's output ("kw": a keyword)
    reads_outputs: frozenset


@dataclass
class Steps:
    """The steps' own graph: the whole template's nodes from the cut on, reading what the
    split replay keeps (the gradients) as inputs."""

    tpl: dict[str, Any]
    fp: str
    ins: list[tuple[str, int]]  # per input: ("in", k) the whole's input k; ("keep", s)
    fill: Callable[[Any, Any], dict[str, Any]]  # the split's kept value s


@dataclass
class Plan:
    """The whole recording's step ops (Note [followed steps])."""

    ops: list[_Op]
    s_cut: int  # the template's scalars before the steps' own
    cut: int = 0  # the template's nodes before the steps' own
    # the whole recording's kept slots of the gradients and outputs -> the split's
    slots: dict[int, int] = field(default_factory=dict)
    steps: Steps | None = None


def plan_of(nodes: list[Node], cut: int, tpl: dict) -> Plan | None:
    """The plan of ``nodes[cut:]``, the steps of a whole recording whose template is
    ``tpl``, read from the template (the nodes let their arguments go once they ran).
    None when they cannot be followed."""
    keep = _kept_slots(tpl)
    ops: list[_Op] = []
    try:
        for n, t in zip(nodes[cut:], tpl["nodes"][cut:], strict=True):
            func = n.op
            if t.get("op") != n.name or "rng" in t or getattr(func, "is_view", False):
                raise _NoPlan
            if n.nout == 0 and func._schema.returns:
                raise _NoPlan  # it returns something the capture returned as it was
            leaves: list[tuple] = []
            found: list[bool] = [False]

            def walk(x: Any, leaves: list[tuple] = leaves, found: list[bool] = found) -> None:
                if type(x) is list:
                    leaves.append(("(", len(x)))
                    for v in x:
                        walk(v)
                elif type(x) is not dict or not x:
                    leaves.append(("v", type(x), x))
                elif len(x) == 1 and "$in" in x:
                    leaves.append(("in", x["$in"]))
                elif len(x) == 1 and "$s" in x:
                    leaves.append(("s",))
                elif type(x.get("$v")) is int and set(x) <= {"$v", "i"}:
                    i, k = x["$v"], x.get("i")
                    if i >= cut:
                        leaves.append(("out", i - cut, k or 0))
                        found[0] = True
                    elif (i, k) in keep:
                        leaves.append(("keep", keep[(i, k)]))
                    else:
                        raise _NoPlan  # a value of the ops before that is not kept
                elif len(x) == 1 and next(iter(x)) in CONSTANT_TAGS:
                    leaves.append(("c", x))
                else:
                    raise _NoPlan  # an inline tensor, an object: not followed

            reads: set[Any] = set()
            for i, v in enumerate(t.get("args", [])):
                found[0] = False
                walk(v)
                if found[0]:
                    reads.add(i)
            kwargs = t.get("kwargs", {})
            found[0] = False
            for v in kwargs.values():
                walk(v)
            if found[0]:
                reads.add("kw")
            specs = n.specs if n.nout else None
            fresh = [i for i, s in enumerate(specs or ()) if s.alias is None]
            new = {i: p for p, i in enumerate(fresh)}
            ops.append(_Op(func, leaves, tuple(kwargs), specs, n.multi, new, frozenset(reads)))
    except _NoPlan:
        return None
    return Plan(ops, _scalars_before(tpl["nodes"][:cut]), cut)


# the tags of the constants ``values.encode_constant`` writes
# (not ``$complex``: its parts are floats, which the template makes scalars)
CONSTANT_TAGS = frozenset({"$dtype", "$device", "$mf", "$layout", "$float"})


def with_slots(plan: Plan | None, whole: Any, split: Any) -> Plan | None:
    """``plan`` for replays of ``split`` following into ``whole`` (two records of one
    call), with where each gradient and output ``whole`` keeps is kept by ``split``; None
    if one is not."""
    if plan is None or len(whole.outputs) != len(split.outputs):
        return None
    theirs = {id(owner): k for k, owner, _spec in split.grads}
    slots: dict[int, int] = {}
    for k, owner, _spec in whole.grads:
        if id(owner) not in theirs:
            return None
        slots[k] = theirs[id(owner)]
    for (kind, what), (their_kind, theirs_what) in zip(whole.outputs, split.outputs, strict=True):
        if kind != their_kind:
            return None
        if kind == "kept":
            slots[what[0]] = theirs_what[0]
    # None: the steps go only with the whole recording (Note [steps followed while the
    # graph runs], replay_followed.py)
    steps = steps_graph(whole.tpl, plan.cut, plan.s_cut, slots)
    return Plan(plan.ops, plan.s_cut, plan.cut, slots, steps)


def steps_graph(tpl: dict, cut: int, s_cut: int, slots: dict[int, int]) -> Steps | None:
    """The graph of the whole template ``tpl``'s steps (its nodes from ``cut`` on, whose
    scalars are the template's from ``s_cut`` on), with each kept value of the nodes
    before (a gradient: kept slot j, the split's ``slots[j]``) read as an input; None if a
    step reads another value of them. Made as the appliance makes a template from a
    graph sent whole (``templates.template``), from a body whose handles name where each
    input comes from and whose floats are their places among ``tpl``'s scalars."""
    if tpl["fetch"]:
        return None
    keep = _kept_slots(tpl)
    source: dict[str, tuple[str, int]] = {}

    def body_of(x: Any) -> Any:
        kind = type(x)
        if kind is list:
            return [body_of(v) for v in x]
        if kind is not dict:
            return x
        if len(x) == 1 and "$in" in x:
            handle = f"in:{x['$in']}"
            source[handle] = ("in", x["$in"])
            return {"$h": handle}
        if len(x) == 1 and "$s" in x:
            return float(x["$s"])
        v = x.get("$v")
        if type(v) is int and set(x) <= {"$v", "i"}:
            if v >= cut:
                return {**x, "$v": v - cut}
            j = keep.get((v, x.get("i")))
            if j is None or j not in slots:
                raise _NoPlan  # a value of the ops before that the split does not keep
            handle = f"keep:{slots[j]}"
            source[handle] = ("keep", slots[j])
            return {"$h": handle}
        return {k: body_of(u) for k, u in x.items()}

    try:
        nodes = body_of(tpl["nodes"][cut:])
    except _NoPlan:
        return None
    kept = [body_of(r) for r in tpl["keep"] if type(r.get("$v")) is int and r["$v"] >= cut]
    steps, inputs, scalars = templates.template({"nodes": nodes, "keep": kept, "fetch": []})
    if scalars != [float(k) for k in range(s_cut, s_cut + len(scalars))]:
        return None  # the steps' floats are not the template's last ones, in order
    return Steps(steps, templates.fingerprint(steps), [source[h] for h in inputs],
                 templates.instantiator(steps))  # fmt: skip


def _kept_slots(tpl: dict) -> dict[tuple[int, Any], int]:
    """The kept slot of each node output the template ``tpl`` keeps, by (node, output)."""
    return {(r["$v"], r.get("i")): j for j, r in enumerate(tpl["keep"]) if "$v" in r}


def _scalars_before(nodes: list[Any]) -> int:
    """How many scalars the template ``nodes`` hold."""

    def count(x: Any) -> int:
        if type(x) is list:
            return sum(count(v) for v in x)
        if type(x) is dict:
            if len(x) == 1 and "$s" in x:
                return 1
            return sum(count(v) for v in x.values())
        return 0

    return count(nodes)


class _Made:
    """An earlier followed op's output in a logged op's arguments."""

    __slots__ = ("k",)

    def __init__(self, k: int) -> None:
        self.k = k


class Follower:
    """One replay's following of its steps (Note [followed steps])."""

    def __init__(
        self, plan: Plan, trace: Any, node: Node, inputs: list[Any], stop: Any, ahead: bool
    ) -> None:
        # node: the replay whose kept values the steps read (their "keep" leaves): the
        # split replay, sent ahead (``ahead``: Note [steps followed while the graph runs],
        # at the split's slots), or the whole recording's, sent after them
        self.plan, self.trace, self.node, self.inputs = plan, trace, node, inputs
        self.stop = stop  # None, or what sends the split replay and rebinds its outputs
        self.slots = plan.slots if ahead else None
        # what the outputs it makes point at: nothing that can be read or sent
        made = sum(len(op.new) for op in plan.ops)
        self.made = Node(torch.ops.aten.empty.memory_format, (), {}, trace, made, multi=True)
        self.floats: list[float] = []
        self.log: list[tuple[Any, Any, Any, list[int]]] = []
        self.weak: list[Any] = []  # the outputs made, weakly
        self.done = False
        self.thread = 0  # the thread following (start)
        self.why = ""  # why it stopped following, if it did
        self.replaced = False  # because a tensor was not the input the plan names

    def start(self) -> None:
        self.thread = threading.get_ident()
        self.trace.follower = self
        with trace_mod.FOLLOWING_LOCK:
            trace_mod.FOLLOWING += 1

    def _end(self) -> None:
        if self.trace.follower is self:
            self.trace.follower = None
        with trace_mod.FOLLOWING_LOCK:
            trace_mod.FOLLOWING -= 1
        self.done = True

    def op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """What capturing ``func`` would return, if it is the next op of the plan; else
        the following stops (``abort``) and ``MISSED`` says to capture it."""
        ops = self.plan.ops
        j = len(self.log)
        if j >= len(ops) or ops[j].func is not func or torch.is_inference_mode_enabled():
            self.abort(f"its steps called {func}, not the recording's op")
            return trace_mod.MISSED
        op = ops[j]
        if tuple(kwargs) != op.kwargs:
            self.abort(f"{func} had other arguments than in the recording")
            return trace_mod.MISSED
        flat: list[Any] = []
        floats: list[float] = []
        it = iter(op.leaves)
        try:
            for v in args:
                self._match(v, it, flat, floats)
            for v in kwargs.values():
                self._match(v, it, flat, floats)
            if next(it, None) is not None:
                raise _Differs
            result, made = self._outputs(op, flat)
        except _Differs:
            self.abort(f"{func} had other arguments than in the recording")
            return trace_mod.MISSED
        self.floats.extend(floats)
        for t in written_values(func, args, kwargs):  # Note [values the client knows]
            if isinstance(t, torch.Tensor):
                writes.readers_sent_into(t, trace_mod.current())  # Note [reads another...]
                writes.forget_known(t)
        reads = op.reads_outputs
        if reads:  # the arguments that hold outputs made
            args = tuple(self._strip(v) if i in reads else v for i, v in enumerate(args))
            if "kw" in reads:
                kwargs = {k: self._strip(v) for k, v in kwargs.items()}
        self.log.append((func, args, kwargs, made))
        return result

    def _match(self, x: Any, it: Any, flat: list, floats: list) -> None:
        want = next(it, None)
        if want is None:
            raise _Differs
        tag = want[0]
        kind = type(x)
        if tag == "(":
            if (kind is not list and kind is not tuple) or len(x) != want[1]:
                raise _Differs
            for v in x:  # a foreach op's list: its tensors without a call of this each
                if isinstance(v, torch.Tensor):
                    self._tensor(v, next(it, _END))
                    flat.append(v)
                else:
                    self._match(v, it, flat, floats)
            return
        if tag == "s":
            if kind is not float or not math.isfinite(x):
                raise _Differs
            floats.append(x)
            return
        if tag == "v":
            if kind is not want[1] or x != want[2]:
                raise _Differs
            return
        if tag == "c":
            if encode_constant(x) != want[1]:
                raise _Differs
            return
        if not isinstance(x, torch.Tensor):
            raise _Differs
        self._tensor(x, want)
        flat.append(x)

    def _tensor(self, x: torch.Tensor, want: tuple) -> None:
        """``x`` is the value the plan says: an input, a kept gradient, an output made."""
        ref = getattr(x.__dict__.get("_b"), "ref", None)
        tag = want[0]
        if tag == "in":
            ok = ref is self.inputs[want[1]] or (
                type(ref) is RemoteTensor and ref.handle == self.inputs[want[1]].handle
            )
            self.replaced = not ok
        elif tag == "keep":  # a kept value of the whole recording (or the split's)
            slot = want[1] if self.slots is None else self.slots.get(want[1])
            node = self.node
            ok = (type(ref) is Pending and ref.node is node and ref.index == slot) or (
                # the split, sent ahead, landed meanwhile (another thread read a value)
                type(ref) is RemoteTensor
                and node.executed
                and node.failed is None
                and slot is not None
                and slot < len(node.results or ())
                and ref is node.results[slot]
            )
        elif tag == "out":  # an earlier followed op's output
            ok = type(ref) is Pending and ref.node is self.made and ref.index == self._out_of(want)
        else:
            ok = False
        if not ok:
            raise _Differs

    def _out_of(self, want: tuple) -> int:
        """The number of op ``want[1]``'s output ``want[2]`` among the outputs made."""
        place = self.plan.ops[want[1]].new.get(want[2])
        return -1 if place is None else self.log[want[1]][3][place]

    def _outputs(self, op: _Op, flat: list) -> tuple[Any, list[int]]:
        """What the capture returns (``lazy._output``): the tensor written into for an
        output that aliases one; a new tensor, bound to nothing it can read, for the
        others."""
        if op.specs is None:
            return None, []
        outs: list[Any] = []
        made: list[int] = []
        for s in op.specs:
            if s.alias is not None:
                target = flat[s.alias] if s.alias < len(flat) else None
                if not isinstance(target, LazyTensor) or (
                    tuple(target.shape),
                    tuple(target.stride()),
                ) != (s.shape, s.stride):
                    raise _Differs
                outs.append(target)
                continue
            k = len(self.weak)
            spec = TensorSpec(s.dtype, s.shape, s.stride, s.offset, None)
            t = LazyTensor(spec, Pending(self.made, k))
            self.weak.append(weakref.ref(t))
            made.append(k)
            outs.append(t)
        if not op.multi:
            return outs[0], made
        kind = type(op.specs)
        return (kind(outs) if kind in (tuple, list) else tuple(outs)), made

    def _strip(self, x: Any) -> Any:
        """``x`` with the followed ops' outputs as markers: the log must not keep them
        alive (one still alive after the steps means they escaped)."""
        kind = type(x)
        if kind is list or kind is tuple:
            return kind(self._strip(v) for v in x)
        if kind is dict:
            return {k: self._strip(v) for k, v in x.items()}
        if isinstance(x, torch.Tensor):
            ref = getattr(x.__dict__.get("_b"), "ref", None)
            if type(ref) is Pending and ref.node is self.made:
                return _Made(ref.index)
        return x

    def finish(self) -> bool:
        """After the steps: whether every op of the plan was followed and nothing they
        made outlives them; else the following stops as for a difference."""
        if self.done:
            return False
        if len(self.log) != len(self.plan.ops):
            self.abort("its steps called fewer ops than the recording's")
            return False
        if any(w() is not None for w in self.weak):
            self.abort("a tensor its steps made outlives them")
            return False
        self._end()
        return True

    def drop(self, why: str) -> None:
        """Stop following (``why``) and capture nothing: the steps are not to run."""
        if not self.done:
            self._end()
            self.why = why
            self.log = []

    def abort(self, why: str) -> None:
        """Stop following (``why``): send the split replay if it was not, capture the ops
        followed so far as they were called, and bind what they made that is still alive
        to the captured outputs (Note [followed steps])."""
        if self.done or threading.get_ident() != self.thread:
            # another thread flushing this trace (reading a value of this one's): what is
            # followed is in no trace yet, and its ops must be captured on this thread
            # (capture records into the calling thread's trace), so it goes on
            return
        self._end()
        self.why = why
        if self.stop is not None:
            self.stop()
        real: dict[int, Any] = {}

        def back(x: Any) -> Any:
            kind = type(x)
            if kind is list or kind is tuple:
                return kind(back(v) for v in x)
            if kind is dict:
                return {k: back(v) for k, v in x.items()}
            return real[x.k] if kind is _Made else x

        for j, (func, args, kwargs, made) in enumerate(self.log):
            out = capture(func, back(args), back(kwargs))
            outs = list(out) if isinstance(out, (list, tuple)) else [out]
            specs = self.plan.ops[j].specs or ()
            new = [o for o, s in zip(outs, specs, strict=False) if s.alias is None]
            for k, t in zip(made, new, strict=True):
                real[k] = t
                ph = self.weak[k]()
                if ph is not None:
                    trace_mod.bind(ph, t._ref)
        self.log = []


class _Differs(Exception):
    pass


_END = ("end",)  # past a plan's last leaf
