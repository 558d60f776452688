"""What a recording of a replayable call keeps, and how it is made from the graph the call
sent (Note [replayable functions], replayable.py; Note [optimizer steps run, not
replayed], replay_steps.py; Note [followed steps], replay_follow.py)."""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from djinn.protocol import templates
from djinn.runtime.graph_forms import worth_a_template
from djinn.runtime.remote import RemoteTensor

from . import own_generators, replay_follow, seeded
from . import trace as trace_mod
from .nodes import Pending
from .replay_key import PLAIN, Miss, State, Used
from .replay_run import same_bytes
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
from .writes import written_roots


@dataclass
class Record:
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
    split: Record | None = None  # the record of its ops before its optimizer steps
    # Note [followed steps] (replay_follow.py): a split record's whole recording, the plan
    # of its steps' ops to follow into it (set once two wholes were alike but for their
    # floats), and that plan before it was
    whole: Record | None = field(default=None, repr=False, compare=False)
    plan: Any = field(default=None, repr=False, compare=False)
    steps_plan: Any = field(default=None, repr=False, compare=False)
    frozen: bool = False  # the call changed state it is checked by: it cannot replay
    unwatched: bool = False  # it made gradients or stepped, and had no recording before
    fill: Any = field(default=None, repr=False, compare=False)  # templates.instantiator
    # per output leaf that is a view: the storage it shares, ("arg", i) or the Storage
    # (Note [writes another thread captured], writes.py)
    shares: dict[int, Any] = field(default_factory=dict, repr=False, compare=False)
    # per random op, in program order: its generator state's place in ``inline`` and how
    # it advanced the generator it draws from (Note [replayed draws])
    draws: list[tuple[int, Any]] = field(default_factory=list, repr=False, compare=False)
    # the values the call read that the client computed, each checked again before a
    # replay (Note [values the client knows], known.py)
    guards: list[Any] = field(default_factory=list, repr=False, compare=False)
    # the keys of the recordings of the same call with other values read (its first only;
    # replayable.MAX_READ_SETS)
    read_sets: set[Any] = field(default_factory=set, repr=False, compare=False)
    same: int = 1  # recordings in a row that gave this record
    unlike: int = 0  # recordings in a row unlike the one before

    def matches(self, other: Record) -> bool:
        return self.scalars == other.scalars and self.alike(other)

    def alike(self, other: Record) -> bool:
        """The same but for the floats: the same template, inputs and outputs."""
        return (
            self.fingerprint == other.fingerprint
            and len(self.scalars) == len(other.scalars)
            and self._shape() == other._shape()
            and self.outputs == other.outputs
            and self.out_spec == other.out_spec
            and len(self.inline) == len(other.inline)
            and self._same_inline(other)
            and [g.value for g in self.guards] == [g.value for g in other.guards]
        )

    def _same_inline(self, other: Record) -> bool:
        """The same inline tensors but for the random ops' generator states (in the same
        slots: each is in the template, which the fingerprint covers)."""
        drawn = {k for k, _ in self.draws}
        pairs = enumerate(zip(self.inline, other.inline, strict=True))
        return all(same_bytes(a, b) for k, (a, b) in pairs if k not in drawn)

    def inline_now(self) -> list[torch.Tensor]:
        """The inline tensors a replay sends: as recorded, but for each random op's
        generator state, drawn now.

        Note [replayed draws]: a random op (dropout in a training step) sends the state
        of the local CPU generator it runs with, and advances that generator as eager's
        would by running on scratch tensors (Note [seeded ops]). A replay runs no op on
        the client, so a call with one ran as it was, op by op, at every call: training
        with dropout never replayed. The states travel as inline tensors, which a replay
        sends anew each time; so a replay now takes, for each random op in program order,
        the generator's state and advances it as the op's capture did (``seeded.Draw``:
        the op again on scratch tensors of the same layouts). The worker draws the
        numbers eager would, and every later random number, local or remote, is eager's
        too. Two recordings are alike with other states in those places. An op that
        draws as many numbers as its inputs' values say (a Poisson sampler) would need
        them read: such a call runs as it is. On a GPU worker's session the state is the
        device generator's seed and offset, and a draw moves the offset on as the
        capture did (``seeded.DeviceDraw``, Note [a GPU worker's generator]); there such
        a sampler replays too. A draw whose op takes a fixed count of the CPU
        generator's outputs is made as that count once learnt (Note [draws by
        count])."""
        if not self.draws:
            return self.inline
        inline = list(self.inline)
        for k, draw in self.draws:
            inline[k] = draw.again()
        return inline

    def _shape(self) -> list[Any]:
        """Where each input and each gradient come from, a held input named by its handle."""
        where = [
            (kind, src if kind == "arg" else id(src) if kind == "grad" else h)
            for (kind, src), h in zip(self.sources, self.handles, strict=True)
        ]
        return [*where, *((k, id(t)) for k, t, _ in self.grads)]


def recorded(
    tr: Any,
    nodes: list[Any],
    result: Any,
    tensors: list[Any],
    reads: dict[Any, list[tuple[Any, Any]]],
    used: Used,
    closure: list[Any],
    generator: tuple[Any, Any],
) -> Record:
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
    if used.skipped is not None:  # Note [steps a replay would skip] (replay_key.py)
        raise Miss(f"it calls {used.skipped}, which a replay would skip", final=True)
    ids = {id(n) for n in nodes}
    draws = [n.draw for n in nodes if n.rng is not None]  # Note [replayed draws]
    if any(type(d) is own_generators.OwnDraw for d in draws):  # Note [explicit generators]
        raise Miss("it draws from a generator of its own (generator=)", final=True)
    if any(d is None for d in draws):
        raise Miss("it draws random numbers as many as its inputs' values say", final=True)
    if not seeded.drawn_alone(*generator, draws):
        raise Miss("it uses the local random generator itself (a seed, a local draw)")
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
    stores: list[Any] = []  # per leaf: the Storage a view shares (writes.py), or None
    for x in leaves:
        stores.append(x.__dict__["_b"].storage if isinstance(x, LazyTensor) else None)
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
    shared = {id(s) for s in stores if s is not None}
    try:
        left = left_in_grad(nodes, returned, owners, shared)
    except Miss:
        left = None  # looked at again outside this block: its traceback holds the tensor
    if left is None:
        # Note [garbage that holds a tensor]: a reference cycle can hold a tensor the call
        # made and dropped until the collector runs (on an op's first capture, frames of
        # PyTorch's addmm decomposition on meta tensors stayed in one, and through the
        # capture's frames held F.linear's arguments). The call does not keep it: collect
        # the young generations once (cheap) and look again.
        gc.collect(1)
        left = left_in_grad(nodes, returned, owners, shared)
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
    if any(n.failed is not None for n in nodes):
        # an op failed when the graph ran (the appliance's Note [partial graphs]): the
        # rest ran again, as eager's `try` in ``fn`` would have it, which a replay, one
        # graph that fails as a whole, cannot do
        raise Miss("an op failed when its graph ran")
    if fetch or len(keep) != len(targets):
        raise Miss("its graph fetched or kept more than it returns")
    parts = (outs, out_spec, tensors, reads, owners, stores, draws)
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


def guarded(guards: list[Any], tensors: list[Any]) -> list[Any]:
    """The values a recording read that the client computed (``known.Program``), their
    leaves named by the argument they are (Note [values the client knows]); a Miss if
    one is a tensor the call was not given, which a replay could not check."""
    at = {id(t.__dict__["_b"].ref): i for i, t in enumerate(tensors)}
    for g in guards:
        for j, (kind, what) in enumerate(g.leaves):
            if kind == "remote":
                if id(what) not in at:
                    raise Miss("it read a value of a tensor it was not given", final=True)
                g.leaves[j] = ("arg", at[id(what)])
    return guards


def _written(nodes: list[Any]) -> set[str]:
    """The handles ``nodes`` write into, through a view of one too (``state[0] += 1``:
    its replays bumped no version and left a value the client kept of the argument
    stale, a review found: the next call's guard read the old value)."""
    return {v.handle for n in nodes for v in written_roots(n) if type(v) is RemoteTensor}


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
) -> Record:
    """The record of a graph the call sent (or of its ops before its optimizer steps);
    ``form``: its template, inputs and scalars when already worked out."""
    outs, out_spec, tensors, reads, owners, stores, draws = parts
    at = [node["rng"] for node in encoded if "rng" in node]  # in node order, as ``draws``
    if len(at) > len(draws):
        raise Miss("a random op's draw is unknown")
    slot = {(id(n), k): j for j, (n, k, _alive) in enumerate(targets)}
    if any(where not in slot for where in left):
        raise Miss("a gradient was not kept")
    grads = [(slot[where], t, spec) for where, (t, spec) in left.items()]
    outputs: list[tuple[str, Any]] = []
    shares: dict[int, Any] = {}
    for (where, what), storage in zip(outs, stores, strict=True):
        if where is None:
            outputs.append(("value", what))
        elif where in slot:
            outputs.append(("kept", (slot[where], spec_key(what))))
            if storage is not None:
                shares[len(outputs) - 1] = _shared_with(storage, tensors)
        else:
            raise Miss("an output was not kept")
    if form is None:
        form = templates.template({"nodes": encoded, "keep": keep, "fetch": []})
    tpl, inputs, scalars = form
    sources, changed = sources_of(inputs, tensors, reads, owners, written)
    return Record(
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
        shares=shares,
        draws=list(zip(at, draws[: len(at)], strict=True)),
    )


def _shared_with(storage: Any, tensors: list[Any]) -> Any:
    """Where a view among the outputs gets its storage at a replay: from the argument
    whose storage it is (each call may pass another tensor), else this one."""
    for i, t in enumerate(tensors):
        if t.__dict__["_b"].storage is storage:
            return ("arg", i)
    return storage
