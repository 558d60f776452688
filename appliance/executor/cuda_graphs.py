"""CUDA graphs for compiled plans: a repeated graph replayed as one launch on a GPU worker.

Note [CUDA graphs for plans]: on a GPU the kernels of a small forward take less time than
the Python that launches them. A compiled plan (Note [compiled plans]) still calls each
op from Python, about 20-30 µs a node on a GPU host, so GPT-2 small's forward of 64
tokens, replayed by ``djinn.replayable``, took 24 ms on an H100 against local eager's
14 ms (``benchmarks/gpu.py``). A CUDA graph records the kernels of one run and launches
them all again with one call, reading and writing the same addresses every time.

So on a GPU worker, with ``cuda_graphs`` on, a compiled plan that qualifies is captured
on its next run and replayed from then on. What qualifies, because a replay runs no
Python per node and reads the same addresses:

- what it writes into an input (a training step's parameters and optimizer state), it
  writes where the input was at capture: a written input is never copied into a buffer
  of the graph's own (below), so a run whose written input sits elsewhere (a new model,
  another session's) captures again where it is, within ``MAX_CAPTURES``. Writes are
  found by alias analysis over the template (schema alias info, written arguments, views
  followed to their root, a view its schema does not declare included:
  ``UNANNOTATED_VIEWS``). See Note [a graph that writes its inputs];
- no random op (each run's generator state would be baked into the graph);
- no inline tensor with bytes, and no constant built from the request's scalars: those
  are read from the request at each run;
- the ops whose checks read values: on a GPU the index guards (Note [indices on a GPU])
  read their indices, which needs a device sync, and no sync can be captured. A guard
  whose indices are computed only from the inputs and constants by at most
  ``PREFIX_NODES`` small nodes is checked before every replay: those nodes run first,
  alone, and the guard reads what they give (GPT-2's token and position ids). Each
  guard's prefix holds what reaches it before it reads: the nodes it reads, theirs, and
  the writes into them that come before it (a write between two guards that read one
  value is in the second's prefix only); a guard another guard reads is run as well as
  checked. Any other
  check that reads values syncs during the capture, which fails it: the plan stays
  compiled;
- the floats the template took out (``scalars``) are those of the capture, bit for bit
  (-0.0 is not 0.0 to a division): a kernel's float arguments are baked into it. A run
  with other scalars captures again only when they are those of the run before: a
  schedule that changes them at every run (a default Adam's bias corrections, Note
  [followed steps]) spent three captures, and their copies of what the plan writes, on
  one run each, then ran compiled; now it spends one;
- its kept and fetched values share no storage with an input or with each other: each
  replay's results are copied out of the graph's buffers, so the next replay cannot
  overwrite what a session holds. A value that is a view of a buffer of the graph's (a
  gradient that is the transpose of a matrix product) is copied with that whole buffer,
  so it keeps its strides and storage offset.

Inputs: the graph reads its inputs where they were at capture. A replay whose input sits
at another address (a new activation, where the weights stay) captures again, with that
input copied into a buffer the graph owns before each replay; a plan is captured at most
``MAX_CAPTURES`` times, then runs compiled when its inputs move.

Memory: a graph keeps the memory its run allocated (its private pool) for as long as it
lives. That is outside the VMU's account, so the graphs of a worker together are bounded
by ``cuda_graph_bytes`` (each counted as its plan's peak rounded up to the allocator's
2 MiB blocks, one more block, and its owned input buffers: ``pool_bytes``);
the least recently replayed is let go first. A plan's stack bytes are reserved for each
replay as for a compiled run.

Results are the same kernels on the same arguments, so the same bits as the compiled run.
A capture that fails (a sync, an op CUDA graphs refuse) is counted and logged, and the
plan runs compiled.

Note [a graph that writes its inputs]: a capture first runs the plan once on a side
stream, outside the capture, so that the libraries' lazy set-up (cuBLAS workspaces, the
allocator's pools) happens where it may; the capture itself computes nothing, and the
capturing run's results come from the replay that follows. A plan that writes into an
input would then be applied twice: once by that warm-up and once by the replay, so an
SGD step would move the weights twice as far. So the warm-up of such a plan runs on
copies of the storages it writes, each written input the same view of its storage's copy
(offsets and aliasing kept: an ``as_strided`` of a view failed on a plain clone), and
only the replay writes the inputs themselves. A plan whose copies and pool together are
over ``cuda_graph_bytes`` is not captured; the copies live only during the warm-up, beside
the graphs' bytes, so for that moment a worker can hold up to about twice the bound. A
replay that writes reports it (``wrote``, Note [rerunnable graphs]): a request whose
results then find no memory is not queued to run again, which would apply it twice.

A graph measured no faster than the compiled plan for a small training step on an H100
(stop 36, ``benchmarks/gpu.py``): there the step's time is not the worker's launches. It
is kept because it is correct and removes the launches where they do count.

An index guard and its prefix (below) run before the replay, on the inputs as they are
then. So a plan is not captured when a guard or its prefix reads an input, or another
input over the same storage (``input_signature``), that a node before the guard writes.
"""

from __future__ import annotations

import logging
import struct
from collections import Counter, OrderedDict
from collections.abc import Callable, Generator
from typing import Any, NamedTuple

import torch

from djinn.errors import ResourceExhausted

from . import index_bounds, opchecks
from .graph import OP_ERRORS, has_extra_checks, op_error, writes
from .graph_buffers import check_outputs, copied, ownable, view_of
from .plan import CompiledRun, Plan, PlanRun
from .plan_source import tagged_with_scalars

log = logging.getLogger("djinn.appliance.cuda_graphs")

PREFIX_NODES = 16  # nodes run before a replay to compute what the index guards read
PREFIX_NUMEL = 1 << 16  # and the most elements each of their outputs may have
MAX_CAPTURES = 3  # captures of one plan (its inputs moved) before it stays compiled
WHYS = 16  # kinds of reason the stats count one by one (refusals, failed captures)
# ops whose output is a view of their first argument though their schema does not say so
# (no ``Tensor(a)``): a write through one writes that argument
UNANNOTATED_VIEWS = frozenset(
    ["aten::_unsafe_view", "aten::unsafe_chunk", "aten::unsafe_split",
     "aten::unsafe_split_with_sizes"]
)  # fmt: skip


class Capture:
    """How a run is captured and replayed: the CUDA one; tests put a CPU stand-in."""

    def supports(self, device: torch.device) -> bool:
        return device.type == "cuda"

    def capture(
        self, device: torch.device, warm: Callable[[], Any], run: Callable[[], list[Any]]
    ) -> tuple[Any, list]:
        """Run ``warm`` (the plan, writing copies of the inputs it writes) on a side stream,
        then capture ``run``; (the graph, its values). The capture computes nothing
        (Note [a graph that writes its inputs])."""
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            warm()  # the libraries' lazy set-up happens outside the capture
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            values = run()
        return graph, values

    def replay(self, graph: Any) -> None:
        graph.replay()


class PlanGraph:
    """One plan's captured graph: what it read and what it gives."""

    def __init__(self) -> None:
        self.graph: Any = None
        self.values: list[Any] = []
        self.scalars = b""  # the capture's scalars, as their bits
        self.addresses: list[int] = []  # each input's data_ptr at capture
        self.owned: dict[int, torch.Tensor] = {}  # input index -> the graph's own buffer
        self.bytes = 0


class Qualified(NamedTuple):
    """``qualifies``'s answer: why not (None if the plan can be a graph), the nodes run
    before each replay, the guard nodes checked then, and the inputs the plan writes."""

    why: str | None
    prefix: list[int]
    guards: list[int]
    written: frozenset[int] = frozenset()


def qualifies(plan: Plan, device: torch.device) -> Qualified:
    """Whether ``plan`` can be replayed as a CUDA graph, and how (Note [CUDA graphs for
    plans], Note [a graph that writes its inputs])."""
    nodes, src = plan.nodes, plan.source_nodes
    refs = [_refs(t.get("args", [])) | _refs(t.get("kwargs", {})) for t in src]
    root: dict[int, tuple[str, int]] = {}  # a view's value -> what it is a view of
    writers: dict[tuple[str, int], list[int]] = {}  # a value's root -> nodes writing it
    guards: list[int] = []
    for i, (node, tpl) in enumerate(zip(nodes, src, strict=True)):
        if node.rng is not None or torch.Tag.nondeterministic_seeded in node.op.tags:
            return Qualified(f"a random op ({node.name})", [], [])
        if ("t", 1) in refs[i] or ("s", 1) in refs[i]:
            return Qualified("an inline tensor or a constant of the request's scalars", [], [])
        of = [_root(r, root) for r in _view_sources(node.op, tpl)]
        if of:  # a view (or the self it wrote): its root is what it is a view of
            root[i] = of[0]
        for r in _written_refs(node.op, tpl) if writes(node.op) else ():
            writers.setdefault(_root(r, root), []).append(i)
        if has_extra_checks(node.op, device) and index_bounds.has_guard(node.op):
            if opchecks.has_check(node.op):
                return Qualified(f"an op with two kinds of checks ({node.name})", [], [])
            guards.append(i)

    # inputs over one storage (input_signature's index) are one value to the guards' rule
    group = [sig[5] for sig in plan.signature] if plan.signature else []
    stored: dict[int, list[int]] = {}  # a storage of inputs -> nodes writing into it
    for (kind, j), ms in writers.items():
        if kind == "in":
            stored.setdefault(group[j] if group else j, []).extend(ms)

    def written_before(r: tuple[str, int], g: int) -> bool:
        """Whether ``r`` is an input whose storage a node before ``g`` writes."""
        r = _root(r, root)
        if r[0] != "in":
            return False
        return any(m < g for m in stored.get(group[r[1]] if group else r[1], ()))

    prefix: set[int] = set()
    for g in guards:  # each guard's own closure: what reaches it before it reads
        # the guard and its prefix run on the inputs as they are before the replay
        if any(written_before(r, g) for r in refs[g]):
            return Qualified("an index guard reads an input the plan writes", [], [])
        seen: set[int] = set()
        todo = [n for k, n in refs[g] if k == "v"]
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            meta = nodes[n].meta
            big = isinstance(meta, torch.Tensor) and meta.numel() > PREFIX_NUMEL
            if len(prefix | seen) > PREFIX_NODES or n in plan.casts or big:
                return Qualified("an index guard reads a value computed by too many nodes", [], [])
            root_n = _root(("v", n), root)
            if any(written_before(r, g) for r in (*refs[n], root_n)):
                return Qualified("an index guard reads an input the plan writes", [], [])
            todo += [m for k, m in refs[n] if k == "v"]
            # what wrote into it before this guard read it (arange's out= into an empty)
            todo += [m for m in writers.get(root_n, ()) if m < g]
        prefix |= seen
    written = frozenset(j for kind, j in writers if kind == "in")
    return Qualified(None, sorted(prefix), guards, written)


def _root(ref: tuple[str, int], root: dict[int, tuple[str, int]]) -> tuple[str, int]:
    """The input or node value that ``ref`` is (a view of)."""
    while ref[0] == "v" and ref[1] in root:
        ref = root[ref[1]]
    return ref


def _refs(x: Any) -> set[tuple[str, int]]:
    """What a template value names: ("in", j) inputs, ("v", n) node values, ("t", 1) an
    inline tensor with bytes, ("s", 1) a tagged constant made of scalars."""
    found: set[tuple[str, int]] = set()

    def walk(v: Any) -> None:
        if isinstance(v, list):
            for u in v:
                walk(u)
        elif isinstance(v, dict):
            if len(v) == 1 and "$in" in v:
                found.add(("in", v["$in"]))
            elif len(v) == 1 and "$s" in v:
                return  # a float argument: the graph is replayed for the same values only
            elif "$v" in v:
                found.add(("v", v["$v"]))
            elif "$t" in v:
                shape = (v.get("desc") or {}).get("shape")
                if not (isinstance(shape, list) and 0 in shape):
                    found.add(("t", 1))
            elif "$h" in v:
                found.add(("t", 1))  # plans refuse these; never replayed either
            elif tagged_with_scalars(v):
                found.add(("s", 1))
            else:
                for u in v.values():
                    walk(u)

    walk(x)
    return found


def _written_refs(op: Any, tpl: dict[str, Any]) -> set[tuple[str, int]]:
    """The references of the arguments ``op`` writes into (``Tensor(a!)``)."""
    return _args_refs(op, tpl, lambda info: info.is_write)


def _view_sources(op: Any, tpl: dict[str, Any]) -> set[tuple[str, int]]:
    """The references of the arguments ``op``'s output may be a view of (``Tensor(a)``,
    or the first argument of an op of ``UNANNOTATED_VIEWS``)."""
    returns = op._schema.returns
    if returns and returns[0].alias_info is not None:
        return _args_refs(op, tpl, lambda info: True)
    if op._schema.name in UNANNOTATED_VIEWS:
        args = tpl.get("args", [])
        return {r for r in _refs(args[:1]) if r[0] in ("in", "v")}
    return set()


def _args_refs(op: Any, tpl: dict[str, Any], which: Callable[[Any], bool]) -> set:
    args, kwargs = tpl.get("args", []), tpl.get("kwargs", {})
    found: set[tuple[str, int]] = set()
    for k, a in enumerate(op._schema.arguments):
        if a.alias_info is None or not which(a.alias_info):
            continue
        if a.kwarg_only or k >= len(args):
            value = kwargs.get(a.name) if isinstance(kwargs, dict) else None
        else:
            value = args[k]
        found |= {r for r in _refs(value) if r[0] in ("in", "v")}
    return found


class CudaGraphs:
    """A GPU worker's captured plans (Note [CUDA graphs for plans]): which run as graphs,
    the bytes they keep (LRU within ``max_bytes``) and the counts the stats show."""

    def __init__(self, enabled: bool, max_bytes: int, capture: Capture | None = None) -> None:
        self.enabled = enabled
        self.max_bytes = max_bytes
        self.capture = capture or Capture()
        self._live: OrderedDict[int, Plan] = OrderedDict()  # id(plan) -> plan, by last use
        self.bytes = 0
        self.captured = 0
        self.replays = 0
        self.failed = 0  # captures that failed: those plans run compiled
        self.refused = 0  # plans that do not qualify
        # why, for each refusal and failed capture: what an operator (or gpu.py) reads to
        # see which plans run compiled and what would make them graphs (at most WHYS kinds)
        self.why: Counter[str] = Counter()
        self.moved = 0  # runs that found an input moved once the captures were spent
        self.run_class = type("GraphedRun", (GraphedRun,), {"graphs": self})

    def runner(self, plan: Plan, runner: type[PlanRun], device: torch.device) -> type[PlanRun]:
        """``GraphedRun`` for a compiled plan that qualifies, else ``runner``."""
        if not self.enabled or runner is not CompiledRun or not self.capture.supports(device):
            return runner
        state = plan.cuda_graph
        if state is None:
            q = qualifies(plan, device)
            why = q.why
            if why is None and pool_bytes(plan.peak) > self.max_bytes:
                why = f"its peak of {plan.peak} bytes is over cuda_graph_bytes"
            if why is not None:
                self.refuse(plan, why)
                return runner
            state = plan.cuda_graph = {"prefix": q.prefix, "guards": q.guards, "graph": None,
                                       "captures": 0, "written": q.written}  # fmt: skip
        return self.run_class if state else runner

    def refuse(self, plan: Plan, why: str) -> None:
        """``plan`` runs compiled from now on (counted, logged)."""
        log.info("graph plan of %d nodes: no CUDA graph (%s)", len(plan.nodes), why)
        self.refused += 1
        self.count_why(why)
        if plan.cuda_graph and plan.cuda_graph["graph"] is not None:
            self.drop(plan)
        plan.cuda_graph = False

    def count_why(self, why: str) -> None:
        if why in self.why or len(self.why) < WHYS:
            self.why[why] += 1
        else:
            self.why["other reasons"] += 1

    def keep(self, plan: Plan, graph: PlanGraph) -> None:
        """Hold ``graph`` for ``plan``, letting go of the least recently used over the bound."""
        old = plan.cuda_graph["graph"]
        if old is not None:
            self.drop(plan)
        plan.cuda_graph["graph"] = graph
        self._live[id(plan)] = plan
        self.bytes += graph.bytes
        while self.bytes > self.max_bytes and len(self._live) > 1:
            _, oldest = self._live.popitem(last=False)
            if oldest is plan:  # never the one just captured
                self._live[id(plan)] = plan
                continue
            self.bytes -= oldest.cuda_graph["graph"].bytes
            oldest.cuda_graph["graph"] = None

    def used(self, plan: Plan) -> None:
        if id(plan) in self._live:
            self._live.move_to_end(id(plan))

    def drop(self, plan: Plan) -> None:
        graph = plan.cuda_graph["graph"]
        plan.cuda_graph["graph"] = None
        if self._live.pop(id(plan), None) is not None:
            self.bytes -= graph.bytes

    def forget(self, plans: list[Plan]) -> None:
        """Plans the worker let go of: their graphs go with them."""
        for plan in plans:
            if plan.cuda_graph and plan.cuda_graph["graph"] is not None:
                self.drop(plan)

    def stats(self) -> dict[str, Any]:
        return {
            "graphs": len(self._live),
            "bytes": self.bytes,
            "captured": self.captured,
            "replays": self.replays,
            "failed": self.failed,
            "refused": self.refused,
            "why": dict(self.why),
            "moved": self.moved,
        }


class GraphedRun(CompiledRun):
    """A compiled plan's request replayed as a CUDA graph (Note [CUDA graphs for plans]);
    a run the graph cannot serve is the compiled run."""

    graphs: CudaGraphs  # set on the worker's subclass (CudaGraphs.run_class)
    capturing = False

    def steps(self) -> Generator[None, None, tuple[list[Any], list[Any]]]:
        state = self.plan.cuda_graph
        if self.partial or not state:
            return (yield from CompiledRun.steps(self))
        graph = state["graph"]
        bits = _bits(self.scs)
        last, state["last"] = state.get("last"), bits
        fits = graph is not None and self._fits(graph, bits)
        if not fits and state["captures"] >= MAX_CAPTURES:
            self.graphs.moved += 1
            self.graphs.count_why(f"runs compiled: {self._misfit(state, graph, bits)}")
            return (yield from CompiledRun.steps(self))
        if not fits and graph is not None and bits != graph.scalars and bits != last:
            # new scalars, not the last run's: captured again once they repeat (the Note)
            self.graphs.count_why("runs compiled: its scalars changed since the run before")
            return (yield from CompiledRun.steps(self))
        self._guard_checks(state)  # before anything ran, as an interpreted run refuses
        if not fits:
            graph = self._capture(state, moved=graph is not None)
            if graph is None:
                return (yield from CompiledRun.steps(self))
        return self._replay(graph)

    def _fits(self, graph: PlanGraph, bits: bytes) -> bool:
        """Whether ``graph`` serves this run, whose scalars are ``bits``."""
        if bits != graph.scalars:  # -0.0 is not 0.0 to a kernel; NaN is NaN
            return False
        return all(
            k in graph.owned or t.data_ptr() == graph.addresses[k] for k, t in enumerate(self.ins)
        )

    def _misfit(self, state: dict[str, Any], graph: PlanGraph | None, bits: bytes) -> str:
        """Why the plan's graph cannot serve this run (its captures spent)."""
        if state.get("stuck"):
            return state["stuck"]
        if graph is None:
            return f"its graph was let go (cuda_graph_bytes) after {MAX_CAPTURES} captures"
        if bits != graph.scalars:
            # e.g. a default Adam's bias corrections: Python floats, new every step
            return f"its scalars change from run to run ({MAX_CAPTURES} captures)"
        return f"its inputs move from run to run ({MAX_CAPTURES} captures)"

    def _guard_checks(self, state: dict[str, Any]) -> None:
        """The index guards, on what the prefix nodes compute from this run's inputs, in
        the plan's order (Note [CUDA graphs for plans])."""
        if not state["guards"]:
            return
        nodes, guards, self.values = self.plan.nodes, set(state["guards"]), {}
        prefix = set(state["prefix"])
        try:
            for n in sorted(guards | prefix):
                node = nodes[n]
                args, kwargs = node.args(self), node.kwargs(self)
                if n in guards:
                    self._value_checks(n, node.op, args, kwargs)
                if n in prefix:  # another guard reads it (a guard too, once checked)
                    try:
                        self.values[n] = node.op(*args, **kwargs)
                    except OP_ERRORS as exc:  # as the compiled run words it (fail())
                        raise op_error(node.name, n, exc) from None
        finally:
            self.values = {}

    def _value_checks(self, i: int, op: Any, args: list, kwargs: dict) -> None:
        if self.capturing and i in self.plan.cuda_graph["guards"]:
            return  # checked before the capture, by _guard_checks
        super()._value_checks(i, op, args, kwargs)

    def _capture(self, state: dict[str, Any], moved: bool) -> PlanGraph | None:
        """Capture this run's plan; None (counted) if CUDA or the plan refuses."""
        plan, graphs = self.plan, self.graphs
        state["captures"] += 1
        old = state["graph"]
        pg = PlanGraph()
        pg.scalars = _bits(self.scs)
        ins = list(self.ins)
        written = state["written"]
        varying = set(old.owned) if old is not None else set()
        if moved:
            varying |= {
                k for k, t in enumerate(ins)
                if k not in old.owned and t.data_ptr() != old.addresses[k]
            }  # fmt: skip
        for k in varying - written:  # a written input is captured where it now is
            t = ins[k]
            if not ownable(t, ins):
                log.info("graph plan: input %d moved and cannot be copied in", k)
                state["captures"] = MAX_CAPTURES
                state["stuck"] = "an input moved that cannot be copied in (a view, or shared)"
                return None
            pg.owned[k] = torch.empty_like(t, memory_format=torch.contiguous_format)
            pg.owned[k].copy_(t)
            ins[k] = pg.owned[k]
        pg.addresses = [t.data_ptr() for t in ins]
        code = plan.code
        # Note [a graph that writes its inputs]: the warm-up writes copies
        stores = {ins[k].untyped_storage().data_ptr(): ins[k].untyped_storage() for k in written}
        copies = sum(st.nbytes() for st in stores.values())
        if copies + pool_bytes(plan.peak) > graphs.max_bytes:
            graphs.refuse(plan, f"the {copies} bytes of inputs it writes are over cuda_graph_bytes")
            return None

        def run(on: list[Any]) -> list[Any]:
            values: list[Any] = [None] * len(plan.nodes)
            for _ in code(self, values, on, self.scs, self.lookup):
                pass
            return values

        def warm() -> list[Any]:
            """The plan on copies of the storages it writes, each input it writes a view
            of its storage's copy as it is of the storage (offsets and aliasing kept)."""
            cloned = {ptr: st.clone() for ptr, st in stores.items()}
            on = list(ins)
            for k in written:
                t = ins[k]
                on[k] = view_of(cloned[t.untyped_storage().data_ptr()], t)
            return run(on)

        try:
            self.stack.reserve(plan.peak)
        except ResourceExhausted:
            state["captures"] -= 1
            return None  # the compiled run waits, or runs what fits (partial)
        self.capturing = True
        try:
            pg.graph, values = graphs.capture.capture(self.device, warm, lambda: run(ins))
            pg.values = [values[n] for n in plan.pinned]
            check_outputs(pg.values, ins)
        except Exception as exc:  # any refusal: this plan runs compiled (counted, logged)
            graphs.failed += 1
            graphs.count_why(f"capture failed: {type(exc).__name__}: {exc}"[:200])
            if old is not None:
                graphs.drop(plan)
            plan.cuda_graph = False
            log.warning("graph plan of %d nodes: CUDA graph capture failed (%s: %s)",
                        len(plan.nodes), type(exc).__name__, exc)  # fmt: skip
            return None
        finally:
            self.capturing = False
            self.stack.release(plan.peak)
        owned = sum(t.untyped_storage().nbytes() for t in pg.owned.values())
        pg.bytes = pool_bytes(plan.peak) + owned
        graphs.captured += 1
        graphs.keep(plan, pg)
        return pg

    def _replay(self, pg: PlanGraph) -> tuple[list[Any], list[Any]]:
        plan = self.plan
        self.stack.reserve(plan.peak)
        try:
            for k, buf in pg.owned.items():
                buf.copy_(self.ins[k])
            # Note [rerunnable graphs]: a replay that wrote in place cannot run again
            self.wrote = plan.first_write < len(plan.nodes)
            self.graphs.capture.replay(pg.graph)
            # a session keeps its results: the next replay writes the graph's buffers again
            self.values = dict(zip(plan.pinned, copied(pg.values), strict=True))
        finally:
            self.stack.release(plan.peak)
        self._reached = len(plan.nodes) - 1
        self.graphs.replays += 1
        self.graphs.used(plan)
        return [self._result(r) for r in self.keep], [self._result(r) for r in self.fetch]


def pool_bytes(peak: int) -> int:
    """What a graph's private memory pool holds for a run whose peak is ``peak`` bytes, at
    least: CUDA's caching allocator gives a pool 2 MiB blocks (one for small tensors, the
    rest rounded up), so many small graphs hold more than their peaks add up to."""
    block = 2 << 20
    return block + -(-peak // block) * block


def _bits(scalars: list[float]) -> bytes:
    return struct.pack(f"<{len(scalars)}d", *scalars)
