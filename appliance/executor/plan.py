"""Execution plans for graph templates: a repeated graph run without re-interpreting it.

Note [graph plans]: a template that keeps coming back (a training step, a forward, an
optimizer step; Note [graph templates]) was interpreted node by node every time: the
template instantiated into a whole graph, each argument decoded from tagged JSON, checked
against its op's schema (``opargs``) and the op's extra checks (``opchecks``), and its
meta outcome looked up under a signature computed from its arguments (``metacheck``,
Note [meta signatures]). For one template, every one of those results is a function of
the graph's inputs' metadata (dtype, sizes, strides, storage offset and size, which
inputs share a storage) and of the floats that reach an op whose output may depend on
their value (an op that is not number-free, Note [number-free signatures]); the graph's
structure (ops, integers, inline tensors' descriptions) is the template itself.

So once a template has run ``graph_plan_after`` times, its next run *records* while it
runs with every check: per node the resolved op, the bytes its meta run said it
allocates and its meta output. If that run completes, the record becomes a plan: per
node the op, closures that build its arguments with every constant decoded once, the
bytes, the meta output. A later request of the same template whose inputs have the same
signature (and the same values for the floats above) runs the plan: the stack is asked
for the recorded bytes (the VMU still decides, and evicts), the real kernel runs, then
everything that follows a kernel in an interpreted run (the dtype the client was told,
the bounds of what it returned, the stack's account, intermediates freed at their last
use). Random ops are seeded per node as before. The kernels and their arguments are the
same, so results are bit-identical to the interpreted run.

The extra checks that read arguments' *values* (targets, offsets, indices) are the
exception: they run on every planned run (Note [value checks in a plan]).

What a plan cannot vouch for runs interpreted: inputs of another signature (a plan per
signature, a few per template), a template with an op that has no meta kernel (its
output's size depends on values, so later nodes' checks cannot be known in advance:
the template is *refused* and never recorded again), a template that names a handle as
it is (``{"$h": h}`` with more keys: a constant of the template, so its tensor's shape is
in no signature; refused too), a recording run that failed.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Generator
from typing import Any

import torch

from djinn.errors import DjinnError, ExecutionError, InvalidArgument, ResourceExhausted
from djinn.protocol.values import decode_constant, inline_tensor

from ..vmu.device import Segment
from . import metacheck, opargs, threads
from .graph import OP_ERRORS, GraphRun, finished, has_extra_checks, op_error, writes
from .plan_source import NotCompilable, compile_plan, tagged_with_scalars

log = logging.getLogger("djinn.appliance.plan")

PLANS_PER_TEMPLATE = 4  # input signatures of one template with a plan each (LRU)
MAX_PLAN_NODES = 200_000  # nodes of all plans together: a worker keeps as many templates
MAX_COUNTED = 4096  # templates whose interpreted runs are counted (the worker keeps 256)

# A compiled argument: (True, the constant) or (False, a getter of the run).
Getter = Callable[["PlanRun"], Any]


class PlanNode:
    __slots__ = ("args", "kwargs", "meta", "name", "need", "op", "rng")

    def __init__(
        self,
        op: Any,
        name: str,
        args: Getter,
        kwargs: Getter,
        need: int,
        meta: Any,
        rng: int | None,
    ) -> None:
        self.op, self.name, self.args, self.kwargs = op, name, args, kwargs
        self.need, self.meta, self.rng = need, meta, rng


class Plan:
    def __init__(
        self,
        tpl: dict[str, Any],
        nodes: list[PlanNode],
        last_use: dict[int, list[int]],
        signature: tuple,
        key_scalars: tuple[int, ...],
        scalar_values: tuple[float, ...],
        scalars: int,
    ) -> None:
        self.nodes = nodes
        self.keep, self.fetch = tpl["keep"], tpl["fetch"]  # references, inputs as {"$in": j}
        self.last_use = last_use
        self.signature = signature
        self.key_scalars = key_scalars  # scalars whose value an op's checks may depend on
        self.scalar_values = scalar_values
        self.scalars = scalars  # how many the template takes
        # Note [compiled plans]: the template's nodes (their arguments), what the recorded
        # run found beyond each node's checks, and the compiled function once there is one
        self.source_nodes: list[dict[str, Any]] = tpl["nodes"]
        self.casts: set[int] = set()
        self.peak = 0
        self.pinned = sorted({r["$v"] for r in self.keep + self.fetch if "$v" in r})
        writes_at = [k for k, node in enumerate(nodes) if writes(node.op)]
        self.first_write = writes_at[0] if writes_at else len(nodes)
        self.runs = 0
        self.code: Callable[..., Any] | None = None
        self.uncompilable = False
        # Note [CUDA graphs for plans]: None until asked, False if it does not qualify
        self.cuda_graph: dict[str, Any] | bool | None = None

    def fits(self, signature: tuple, scalars: list[float]) -> bool:
        return (
            signature == self.signature
            and len(scalars) == self.scalars
            and tuple(scalars[k] for k in self.key_scalars) == self.scalar_values
        )


def input_signature(tensors: list[torch.Tensor]) -> tuple:
    """What a graph's checks see of its inputs (Note [graph plans])."""
    shared: dict[int, int] = {}
    out = []
    for t in tensors:
        st = t.untyped_storage()
        out.append(
            (
                t.dtype,
                t.shape,
                t.stride(),
                t.storage_offset(),
                st.nbytes(),
                shared.setdefault(st._cdata, len(shared)),
            )
        )
    return tuple(out)


class PlanRun(GraphRun):
    """A template's request run by its plan; stepping, partial graphs, the stack's
    account and the reply are ``GraphRun``'s."""

    def __init__(
        self,
        plan: Plan,
        fp: str,
        body: dict[str, Any],
        inputs: list[str],
        tensors: list[torch.Tensor],
        lookup: Callable[[str], torch.Tensor],
        segments: list[memoryview],
        device: torch.device,
        stack: Segment,
    ) -> None:
        whole = {
            "nodes": plan.nodes,
            "keep": _refs(plan.keep, inputs),
            "fetch": _refs(plan.fetch, inputs),
            "partial": body.get("partial") is True,
        }
        super().__init__(whole, lookup, segments, device, stack)
        self.plan = plan
        self.template = fp
        self.ins = tensors
        self.scs: list[float] = body["scalars"]

    def _last_uses(self) -> dict[int, list[int]]:
        return dict(self.plan.last_use)

    def _source_nodes(self) -> list[Any]:
        return self.plan.source_nodes

    def _node(self, i: int, node: Any, last_use: dict[int, list[int]]) -> None:
        if node.rng is not None:
            self._seed(node.rng)
        args, kwargs = node.args(self), node.kwargs(self)
        if has_extra_checks(node.op, self.device):
            self._value_checks(i, node.op, args, kwargs)
        if node.need >= 0:  # an op with no meta kernel never makes it into a plan
            self._make_room(node.op, node.need, i)
        self._call(i, node.op, node.name, args, kwargs, node.meta, last_use)

    def inline(self, x: dict[str, Any]) -> torch.Tensor:
        """An inline tensor of this request (its bytes are in the request's segments)."""
        return inline_tensor(x, self.segments, self.device)

    def filled(self, x: dict[str, Any]) -> Any:
        """A tagged constant made of this request's scalars (``tagged_with_scalars``)."""
        return decode_constant(_filled(x, self.scs), self.device)[1]

    def _value_checks(self, i: int, op: Any, args: list, kwargs: dict) -> None:
        """Note [value checks in a plan]: the signature a plan is chosen by holds the
        inputs' metadata, not their values, and several extra checks read values (nll's
        targets, CTC's, segment offsets; indices on a GPU, Note [indices on a GPU]). A
        template recorded with valid targets took a crafted out-of-range one on its next
        planned run straight to the kernel (nll_loss_backward writes there unchecked: a
        SIGSEGV of the worker). Those checks run on every planned run."""
        try:
            self._extra_checks(op, opargs.bind(op, args, kwargs, self.device))
        except (InvalidArgument, ExecutionError) as exc:
            raise type(exc)(f"node {i}: {exc.message}") from None


class CompiledRun(PlanRun):
    """A template's request run by its plan's compiled function (Note [compiled plans])."""

    def steps(self) -> Generator[None, None, tuple[list[Any], list[Any]]]:
        plan, code = self.plan, self.plan.code
        assert code is not None
        try:
            self.stack.reserve(plan.peak)  # short: nothing ran yet, so the request may wait
        except ResourceExhausted:
            if not self.partial:
                raise
            # Note [partial graphs]: the nodes that fit run, and the run ends at the first
            # that does not, as a plan run node by node ends
            return (yield from PlanRun.steps(self))
        self._reached = len(plan.nodes) - 1
        values: list[Any] = [None] * len(plan.nodes)
        try:
            yield from code(self, values, self.ins, self.scs, self.lookup)
        finally:
            self.stack.release(plan.peak)
            self.wrote = plan.first_write <= self._reached
        if self.failed is None:
            self.values = {n: values[n] for n in plan.pinned}
        else:  # Note [values the rest reads] (graph.py): what is still live, too
            self.values = {n: v for n, v in enumerate(values) if v is not None}
        return [self._result(r) for r in self.keep], [self._result(r) for r in self.fetch]

    # -- called by the compiled function -------------------------------------------------
    def enter(self) -> None:
        if self.threads is not None:
            threads.use(self.threads)

    def leave(self) -> None:
        if self.threads is not None:
            threads.use(threads.base())

    def slow(self, i: int, args: list[Any], kwargs: dict[str, Any]) -> Any:
        """A node that needs more than its kernel, as an interpreted node runs it."""
        node = self.plan.nodes[i]
        if node.rng is not None:
            self._seed(node.rng)
        if has_extra_checks(node.op, self.device):
            self._value_checks(i, node.op, args, kwargs)
        out = node.op(*args, **kwargs)
        return finished(self.device, node.op, node.name, args, kwargs, out, node.meta)

    def fail(self, i: int, exc: Exception) -> None:
        """Node ``i`` raised ``exc``: raise what an interpreted run raises, or with
        "partial" end the run there (Note [partial graphs])."""
        self._reached = i
        if isinstance(exc, DjinnError):
            error = exc
        elif isinstance(exc, OP_ERRORS):
            error = op_error(self.plan.nodes[i].name, i, exc)
        else:
            raise exc
        if not self.partial:
            raise error from None
        self.failed = (i, error)


def _refs(refs: Any, inputs: list[str]) -> list[dict[str, Any]]:
    """A template's keep / fetch references with its inputs put back."""
    return [{"$h": inputs[r["$in"]]} if "$in" in r else r for r in refs]


class GraphPlans:
    """The worker's plans, by template fingerprint and input signature (bounded LRU),
    and the counts the stats document shows."""

    def __init__(self, after: int, max_nodes: int = MAX_PLAN_NODES, compile_after: int = 0) -> None:
        self.after = after  # interpreted runs of a template before one records; 0: never
        self.compile_after = compile_after  # planned runs before it compiles; 0: never
        self.max_nodes = max_nodes
        self._plans: OrderedDict[str, list[Plan]] = OrderedDict()
        self._nodes = 0
        self._runs: dict[str, int] = {}  # interpreted runs since the template's last plan
        self._refused: set[str] = set()  # templates no plan can serve
        self.plan_runs = 0
        self.recorded = 0
        self.refused = 0
        self.compiled = 0  # plans compiled (Note [compiled plans])
        self.compiled_runs = 0
        self.uncompiled = 0  # plans the generator would not write, or compile() refused
        # told of the plans let go (the worker's CUDA graphs go with them)
        self.dropped: Callable[[list[Plan]], None] = lambda plans: None

    def find(self, fp: str, signature: tuple, scalars: list[float]) -> Plan | None:
        plans = self._plans.get(fp)
        if plans:
            for plan in plans:
                if plan.fits(signature, scalars):
                    self._plans.move_to_end(fp)
                    self.plan_runs += 1
                    return plan
        return None

    def runner(self, plan: Plan, fp: str, device: torch.device) -> type[PlanRun]:
        """How ``plan`` runs this time: compiled once it has run ``compile_after`` times
        (Note [compiled plans]), else node by node. A plan that cannot be compiled is
        counted and runs as a plan."""
        if plan.code is None:
            plan.runs += 1
            if not self.compile_after or plan.uncompilable or plan.runs <= self.compile_after:
                return PlanRun
            try:
                plan.code = _compile_plan(plan, fp, device)
            except Exception as exc:  # any failure: the plan runs as it is (counted, logged)
                plan.uncompilable = True
                self.uncompiled += 1
                log.warning("graph template %s: not compiled (%s)", fp[:12], exc)
                return PlanRun
            self.compiled += 1
        self.compiled_runs += 1
        return CompiledRun

    def should_record(self, fp: str) -> bool:
        """Count an interpreted run of ``fp``; whether this one records a plan."""
        if self.after <= 0 or fp in self._refused:
            return False
        runs = self._runs[fp] = self._runs.get(fp, 0) + 1
        if len(self._runs) > MAX_COUNTED:  # templates let go since: count them again
            self._runs.clear()
        return runs > self.after

    def record(
        self,
        fp: str,
        tpl: dict[str, Any],
        run: GraphRun,
        signature: tuple,
        scalars: list[float],
        device: torch.device,
    ) -> Plan | None:
        """Make a plan of ``tpl`` from a completed run that recorded (Note [graph plans])."""
        recording = run.recording
        if recording is None or run.failed is not None or len(recording) != len(tpl["nodes"]):
            return None  # it failed part-way: the next run records again
        why = None
        # need < 0 marks an op without a meta kernel (GraphRun._check); a meta output of
        # None is an op that returns nothing (an in-place _foreach_ op), and plannable
        metaless = sorted({str(op) for op, need, _meta in recording if need < 0})
        if metaless:  # data-dependent sizes: never plannable
            why = "an op without a meta kernel: " + ", ".join(metaless[:3])
        elif _names_handle(tpl):
            # Note [graph plans]: a handle the template kept as it is (one with more keys
            # than "$h") is a constant of the template, so its tensor's shape is in no
            # signature: a plan recorded with it small would vouch for it grown
            why = "a handle the template keeps as it is"
        if why is not None:
            log.info("graph template %s: no plan (%s)", fp[:12], why)
            self._refused.add(fp)
            self._runs.pop(fp, None)
            self.refused += 1
            return None
        nodes, key_scalars = [], set()
        for node, (op, need, meta) in zip(tpl["nodes"], recording, strict=True):
            args, kwargs = (
                _compile(node.get("args", []), device),
                _compile(node.get("kwargs", {}), device),
            )
            if not metacheck._shape_free(op):
                _scalars_in(node.get("args"), key_scalars)
                _scalars_in(node.get("kwargs"), key_scalars)
            rng = node.get("rng")
            nodes.append(
                PlanNode(
                    op,
                    node.get("op"),
                    _getter(args),
                    _getter(kwargs),
                    need,
                    meta,
                    rng if type(rng) is int else None,
                )
            )
        keys = tuple(sorted(key_scalars))
        plan = Plan(
            tpl,
            nodes,
            run._last_uses(),
            signature,
            keys,
            tuple(scalars[k] for k in keys),
            len(scalars),
        )
        plan.casts, plan.peak = set(run.casts), run.peak_held
        plans = self._plans.setdefault(fp, [])
        plans.insert(0, plan)
        self._nodes += len(nodes)
        while len(plans) > PLANS_PER_TEMPLATE:
            gone = plans.pop()
            self._nodes -= len(gone.nodes)
            self.dropped([gone])
        self._plans.move_to_end(fp)
        while self._nodes > self.max_nodes and self._plans:
            _, old = self._plans.popitem(last=False)
            self._nodes -= sum(len(p.nodes) for p in old)
            self.dropped(old)
        self._runs.pop(fp, None)
        self.recorded += 1
        log.info("graph template %s: plan recorded (%d nodes)", fp[:12], len(nodes))
        return plan

    def stats(self) -> dict[str, int]:
        return {
            "plans": sum(len(p) for p in self._plans.values()),
            "nodes": self._nodes,
            "runs": self.plan_runs,
            "recorded": self.recorded,
            "refused": self.refused,
            "compiled": self.compiled,
            "compiled_runs": self.compiled_runs,
            "uncompiled": self.uncompiled,
        }


def _compile_plan(plan: Plan, fp: str, device: torch.device) -> Callable[..., Any]:
    """Note [compiled plans]: which nodes need more than their kernel, then the source."""

    def slow(i: int) -> bool:
        node = plan.nodes[i]
        return (
            node.rng is not None
            or i in plan.casts
            or has_extra_checks(node.op, device)
            or "as_strided" in node.op._schema.name
        )

    if len(plan.source_nodes) != len(plan.nodes):
        raise NotCompilable("the template and its plan differ")
    return compile_plan(
        plan.nodes,
        plan.source_nodes,
        plan.last_use,
        slow,
        len(plan.signature),
        plan.scalars,
        device,
        fp[:12],
    )


# -- compiling a template's arguments --------------------------------------------------------
def _compile(x: Any, device: torch.device) -> tuple[bool, Any]:
    """A template value as (True, its decoded constant) or (False, a getter of the run)."""
    if isinstance(x, list):
        parts = [_compile(v, device) for v in x]
        if all(const for const, _ in parts):
            return True, [v for _, v in parts]
        base = [v if const else None for const, v in parts]
        dyn = [(k, g) for k, (const, g) in enumerate(parts) if not const]

        def build_list(run: PlanRun) -> list[Any]:
            out = base.copy()
            for k, g in dyn:
                out[k] = g(run)
            return out

        return False, build_list
    if not isinstance(x, dict):
        return True, x
    if len(x) == 1 and "$in" in x:
        j = x["$in"]
        return False, lambda run: run.ins[j]
    if len(x) == 1 and "$s" in x:
        k = x["$s"]
        return False, lambda run: run.scs[k]
    if "$h" in x:  # kept as it is (more keys than "$h"): plans refuse these (_names_handle)
        handle = x["$h"]
        return False, lambda run: run.lookup(handle)
    if "$v" in x:
        n, i = x["$v"], x.get("i")
        if i is None:
            return False, lambda run: run.values[n]
        return False, lambda run: run.values[n][i]
    if "$t" in x:
        return False, lambda run: run.inline(x)
    if tagged_with_scalars(x):
        return False, lambda run: run.filled(x)
    found, value = decode_constant(x, device)
    if found:
        return True, value
    items = {k: _compile(v, device) for k, v in x.items()}
    if all(const for const, _ in items.values()):
        return True, {k: v for k, (_, v) in items.items()}
    fixed = {k: v for k, (const, v) in items.items() if const}
    moving = [(k, g) for k, (const, g) in items.items() if not const]

    def build_dict(run: PlanRun) -> dict[str, Any]:
        out = fixed.copy()
        for k, g in moving:
            out[k] = g(run)
        return out

    return False, build_dict


def _getter(compiled: tuple[bool, Any]) -> Getter:
    const, value = compiled
    if not const:
        return value
    if isinstance(value, list):
        return lambda run: value.copy()  # a fresh top-level list each run, as decoded
    if isinstance(value, dict):
        return lambda run: value.copy()
    raise InvalidArgument("a node's args must be a list and its kwargs an object")


def _names_handle(x: Any) -> bool:
    if isinstance(x, list):
        return any(_names_handle(v) for v in x)
    if isinstance(x, dict):
        return "$h" in x or any(_names_handle(v) for v in x.values())
    return False


def _scalars_in(x: Any, found: set[int]) -> None:
    if isinstance(x, list):
        for v in x:
            _scalars_in(v, found)
    elif isinstance(x, dict):
        if len(x) == 1 and "$s" in x:
            found.add(x["$s"])
        else:
            for v in x.values():
                _scalars_in(v, found)


def _filled(x: Any, scalars: list[float]) -> Any:
    """``x`` with its ``{"$s": k}`` put back."""
    if isinstance(x, list):
        return [_filled(v, scalars) for v in x]
    if isinstance(x, dict):
        if len(x) == 1 and "$s" in x:
            return scalars[x["$s"]]
        return {k: _filled(v, scalars) for k, v in x.items()}
    return x
