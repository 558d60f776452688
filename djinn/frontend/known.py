"""Values the client knows without asking the appliance, and the checks a replay makes of
the values its recording read (Note [values the client knows]).

Note [values the client knows]: a model's forward often reads a value of a small integer
tensor it was given: Hugging Face's mask helpers ask ``attention_mask.all()`` to skip the
mask when nothing is padded. Such a read waited for a graph of its own, and inside a
``djinn.replayable`` call it made the call run as it was at every call (its Python
branched on the value; a replay, which runs none of it, could not know the branch still
held): BERT given an attention mask never replayed. Yet the value is the client's own:
the mask was uploaded from a CPU tensor a moment before. So:

- An upload (``x.to(remote)``) of a small integer or bool tensor keeps a private copy on
  its handle (``RemoteTensor.known``), with the ``Storage`` mark the tensor shares with
  its views (writes.py). Any write into the tensor, a view of it, or the handle (a
  captured op, a replay, a followed step) drops it (``writes.forget_known``).
- A value read (``.item()``, ``bool(t)``) of a tensor made from such tensors and inline
  constants by ops of this thread's trace not sent yet runs those ops on the CPU, on
  the copies, when every value on the way is integer or bool and small, and every op is
  an ``aten`` op that writes into nothing and draws no random numbers (``evaluate``).
  Integer and bool kernels give the same bits on every device, so the value is the one
  the appliance would give. Not where a write not sent yet goes into a value on the way
  or a view of one (``_written_on_the_way``), nor where an op would make a tensor too
  large (known from its spec before it runs). Outside a recording, where ops the client
  could not compute wait to be sent, they are sent where the read was and waited for, as
  the read did before: the graphs are cut where they were (an int read and used in the
  ops after it, in one graph, made a template per value, each run op by op), and an
  error of those ops is the read's (a singular ``inv``'s check; sent without waiting, a
  review found it raised later, on another thread that landed it, or never).
- Inside a recording, such a read becomes a *guard*: the ops from the call's arguments
  (and constants) to the value, and the value. Before each replay the guards run again
  on the new arguments' copies; a different value, or an argument whose value the client
  does not know, records the call again (``read_now``), or replays the recording kept for
  the values read now (a key keeps one per set of values, at most
  ``replayable.MAX_READ_SETS`` besides its first; past that, a call whose values are new
  runs as it is). A read that cannot be evaluated so waits for the appliance as before,
  and the call runs as it is.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from djinn.runtime.remote import RemoteTensor

from .failures import written_args
from .nodes import HostTensor, Pending
from .writes import WRITES, shared_storage, written_roots

KNOWN_MAX = 1 << 16  # elements of a tensor kept or computed on the client
NODES_MAX = 64  # ops run on the client for one read
_EXACT = {
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
}
_CPU = torch.device("cpu")
# The ops run on the client: those whose integer results are the same on every device.
# Not a sort, top-k, unique or arg-reduction (ties may come out in another order on
# another device), nor ``empty`` (its values are whatever the memory held), nor
# ``as_strided`` (it reads the storage, which a copy on the client need not lay out as
# the appliance's does).
_OPS = frozenset(
    {
        # views and copies
        "alias", "clone", "contiguous", "expand", "flatten", "flip",
        "lift_fresh", "lift_fresh_copy", "narrow", "permute", "repeat", "reshape",
        "roll", "select", "slice", "split", "split_with_sizes", "squeeze", "t",
        "transpose", "unbind", "unflatten", "unsqueeze", "view", "_reshape_alias",
        "_to_copy", "_unsafe_view", "to",
        # arithmetic, comparison and logic
        "abs", "add", "bitwise_and", "bitwise_not", "bitwise_or", "bitwise_xor", "clamp",
        "clamp_max", "clamp_min", "div", "eq", "floor_divide", "ge", "gt", "le",
        "logical_and", "logical_not", "logical_or", "logical_xor", "lt", "maximum",
        "minimum", "mul", "ne", "neg", "remainder", "rsub", "sign", "sub", "where",
        # reductions and scans
        "all", "amax", "amin", "any", "count_nonzero", "cumsum", "prod", "sum",
        # made from nothing, or from others
        "arange", "cat", "diff", "fill", "full", "full_like", "gather", "index_select",
        "masked_fill", "new_full", "new_ones", "new_zeros", "ones", "ones_like",
        "scalar_tensor", "stack", "tril", "triu", "zeros", "zeros_like",
    }
)  # fmt: skip
_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.layout, torch.memory_format)


class Unknown(Exception):
    """A value the client cannot compute by itself."""


def exact(t: torch.Tensor) -> bool:
    """An integer or bool tensor small enough to keep or compute on the client."""
    return t.dtype in _EXACT and t.numel() <= KNOWN_MAX


def remember(remote: RemoteTensor, value: torch.Tensor, storage: Any) -> None:
    """``remote`` was uploaded from ``value``, a CPU tensor the caller found ``exact``:
    keep a copy (Note [values the client knows]); ``storage``, the mark the tensor bound
    to it shares with its views."""
    remote.known = (value.detach().clone(), storage)


def known_value(remote: RemoteTensor) -> torch.Tensor | None:
    """The value the client keeps of ``remote``, if it still holds."""
    known = remote.known
    if known is None or remote.failed is not None:
        return None
    value, storage = known
    if storage is not None and storage.written:
        remote.known = None
        return None
    return value


class Program:
    """The ops from a read's leaves to the value it read, to run again (a guard).

    ``leaves``: per leaf, ``("remote", RemoteTensor)`` (mapped to ``("arg", i)`` by a
    recording) or ``("const", tensor)``; ``steps``: ``(op, args, kwargs)`` whose tensors
    are ``_Leaf``/``_Out`` markers; ``out``: the marker of the tensor read; ``read``: the
    op that read it (``_local_scalar_dense``, ``is_nonzero``); ``value``: what it gave."""

    __slots__ = ("leaves", "out", "read", "steps", "value")

    def __init__(self) -> None:
        self.leaves: list[tuple[str, Any]] = []
        self.steps: list[tuple[Any, Any, Any]] = []
        self.out: Any = None
        self.read: Any = None
        self.value: Any = None

    def run(self, leaves: list[torch.Tensor]) -> Any:
        outs: list[Any] = []

        def sub(a: Any) -> Any:
            if type(a) is _Leaf:
                return leaves[a.i]
            if type(a) is _Out:
                got = outs[a.step]
                return got if a.index is None else got[a.index]
            if type(a) in (list, tuple):
                return type(a)(sub(v) for v in a)
            return a

        for op, args, kwargs in self.steps:
            outs.append(op(*sub(args), **sub(kwargs)))
        return self.read(sub(self.out))

    def now(self, tensors: list[Any], trace: Any) -> Any:
        """What the read gives on the call's arguments ``tensors``; None where the client
        cannot tell."""
        values = []
        for kind, what in self.leaves:
            if kind == "const":
                values.append(what)
                continue
            value = evaluate(tensors[what], trace) if kind == "arg" else None
            if value is None:
                return None
            values.append(value[0])
        try:
            return self.run(values)
        except (RuntimeError, IndexError, ValueError, TypeError):
            return None  # a shape the recorded ops do not take


def read_now(guards: list[Program], tensors: list[Any], trace: Any) -> list[Any]:
    """What each of a recording's reads gives on ``tensors`` now (None: not known)."""
    return [g.now(tensors, trace) for g in guards]


class _Leaf:
    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i


class _Out:
    __slots__ = ("index", "step")

    def __init__(self, step: int, index: int | None) -> None:
        self.step = step
        self.index = index


class _Walk:
    """One evaluation: the values and markers of what it has run so far."""

    def __init__(self, trace: Any) -> None:
        self.trace = trace
        self.program = Program()
        self.ran: dict[int, tuple[int, Any]] = {}  # id(node) -> (step, its outputs)
        self.leaf_at: dict[int, int] = {}  # id(leaf object) -> leaf index

    def leaf(self, kind: str, obj: Any, value: torch.Tensor) -> tuple[Any, Any]:
        at = self.leaf_at.get(id(obj))
        if at is None:
            at = self.leaf_at[id(obj)] = len(self.program.leaves)
            self.program.leaves.append((kind, obj))
        return _Leaf(at), value

    def ref(self, ref: Any) -> tuple[Any, Any]:
        """The marker and the value of a node's argument."""
        kind = type(ref)
        if kind is RemoteTensor:
            value = known_value(ref)
            if value is None:
                raise Unknown
            return self.leaf("remote", ref, value)
        if kind is Pending:
            step, outs = self.node(ref.node)
            if ref.node.multi:
                return _Out(step, ref.index), outs[ref.index]
            return _Out(step, None), outs
        if kind is HostTensor:
            ref = ref.tensor
        if isinstance(ref, torch.Tensor):
            if ref.device.type != "cpu" or not exact(ref):
                raise Unknown
            return self.leaf("const", ref, ref)
        if kind in (list, tuple):
            pairs = [self.ref(v) for v in ref]
            return kind(m for m, _ in pairs), kind(v for _, v in pairs)
        if kind is torch.device:
            return _CPU, _CPU  # a factory's or a move's device: run here
        if not isinstance(ref, _PLAIN):
            raise Unknown  # a value that failed, not made yet...
        return ref, ref

    def node(self, node: Any) -> tuple[int, Any]:
        done = self.ran.get(id(node))
        if done is not None:
            return done
        op = node.op
        if (
            node.trace is not self.trace
            or node.executed
            or node.inflight is not None
            or node.failed is not None
            or node.rng is not None
            or node.args is None
            or getattr(op, "namespace", None) != "aten"
            or op._opname not in _OPS
            or written_args(op)
            or len(self.ran) >= NODES_MAX
        ):
            raise Unknown
        for spec in node.specs or ():  # what it would make, before making it
            shape = getattr(spec, "shape", None)
            if shape is not None and (spec.dtype not in _EXACT or math.prod(shape) > KNOWN_MAX):
                raise Unknown
        args = [self.ref(a) for a in node.args]
        kwargs = {k: self.ref(v) for k, v in node.kwargs.items()}
        try:
            outs = op(*[v for _, v in args], **{k: v for k, (_, v) in kwargs.items()})
        except Exception as exc:  # the appliance says what is wrong, in its words
            raise Unknown from exc
        for t in outs if node.multi else (outs,):
            if isinstance(t, torch.Tensor) and not exact(t):
                raise Unknown
        step = len(self.program.steps)
        self.program.steps.append(
            (op, [m for m, _ in args], {k: m for k, (m, _) in kwargs.items()})
        )
        self.ran[id(node)] = (step, outs)
        return step, outs


def _written_on_the_way(walk: _Walk, nodes: list[Any]) -> bool:
    """Whether a node of ``nodes`` writes into a value the walk used, or into a view of
    one (``arange``'s ``out=`` into the tensor it makes does not count)."""
    used = set(walk.ran) | {id(obj) for kind, obj in walk.program.leaves if kind == "remote"}
    for n in nodes:
        if not n.bases and not written_args(n.op):
            continue
        for ref in written_roots(n):
            if id(ref.node if type(ref) is Pending else ref) in used:
                return True
    return False


def evaluate(x: Any, trace: Any) -> tuple[torch.Tensor, Program] | None:
    """``x``'s value computed on the client, and the program that computed it; None
    where it cannot be (Note [values the client knows])."""
    cell = x.__dict__.get("_b")
    if cell is None or x.dtype not in _EXACT or x.numel() > KNOWN_MAX:
        return None  # a loss's .item(): nothing to look at
    with trace.lock:  # a flush on another thread would take the nodes away
        walk = _Walk(trace)
        try:
            marker, value = walk.ref(cell.ref)
        except Unknown:
            return None
        if walk.ran and _written_on_the_way(walk, trace.nodes):
            return None  # a write not sent may change a value on the way
    if not isinstance(value, torch.Tensor):
        return None
    walk.program.out = marker
    return value, walk.program


def carried(tensors: list[Any], trace: Any) -> tuple[int, list[tuple[Any, torch.Tensor]]]:
    """The values of a call's arguments made by ops of ``trace`` not sent yet that the
    client can compute (a slice or a cast of an uploaded mask, made before the call), for
    ``keep_carried`` once the flush before a recording or a replay's checks has sent those
    ops: without a copy on the handle, the call's read of it could not be computed, and
    the call ran as it is at every call (a review's variants of stop 46's BERT). With
    them, the count of writes so far (``writes.WRITES``)."""
    writes = WRITES[0]
    out = []
    for t in tensors:
        cell = t.__dict__.get("_b")
        if cell is not None and type(cell.ref) is Pending:
            got = evaluate(t, trace)
            if got is not None:
                out.append((t, got[0]))
    return writes, out


def keep_carried(carried: tuple[int, list[tuple[Any, torch.Tensor]]]) -> None:
    """Each value ``carried`` computed, kept on its tensor's handle now that it has one;
    none if any write was captured (or a replay's forgotten) on any thread since. Another
    thread's write into an upload the value was computed from, sent between ``carried``
    and the flush, made the appliance's value differ from the client's, and a copy (a
    cast) shares no storage mark with that upload to show it: a review's replay then
    took the wrong branch at every call."""
    writes, pairs = carried
    if WRITES[0] != writes:
        return
    for t, value in pairs:
        ref = t.__dict__["_b"].ref
        if type(ref) is RemoteTensor and ref.known is None and ref.failed is None:
            ref.known = (value, shared_storage(t))


def computable(trace: Any) -> bool:
    """Whether the client could compute every op ``trace`` holds not sent yet: only the
    ops of reads it computed, which need not go now (Note [values the client knows])."""
    with trace.lock:
        walk = _Walk(trace)
        try:
            for node in trace.nodes:
                walk.node(node)
        except Unknown:
            return False
    return True
