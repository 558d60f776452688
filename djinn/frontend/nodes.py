"""The data of a trace: captured ops (``Node``), their pending outputs (``Pending``), the
cell through which a LazyTensor holds one (``Binding``), and the small CPU tensors an op
wants on the host (``HostTensor``)."""

from __future__ import annotations

import itertools
import weakref
from typing import TYPE_CHECKING, Any

import torch

from djinn.errors import DjinnError
from djinn.runtime.remote import RemoteTensor

if TYPE_CHECKING:
    from .inflight import Sent
    from .trace import Trace


class Node:
    """One captured aten call. ``args``/``kwargs`` hold refs, never LazyTensors, so a
    pending graph does not keep user tensors alive."""

    __slots__ = (
        "__weakref__",
        "args",
        "bases",
        "draw",
        "executed",
        "failed",
        "holders",
        "inflight",
        "kwargs",
        "module",
        "multi",
        "nout",
        "op",
        "results",
        "rng",
        "specs",
        "storages",
        "trace",
    )

    def __init__(
        self, op: Any, args: Any, kwargs: Any, trace: Trace, nout: int, multi: bool = False
    ) -> None:
        self.op = op
        self.multi = multi or nout > 1  # outputs are a tuple/list: refer to them by index
        self.args = args
        self.kwargs = kwargs
        self.trace = trace
        self.nout = nout
        # per output, the bindings that held it (weakly): Note [bindings]
        self.holders: list[list[weakref.ref[Binding]]] = [[] for _ in range(nout)]
        self.results: list[RemoteTensor | None] | None = None
        self.executed = False
        self.inflight: Sent | None = None  # Note [asynchronous flushes]: sent, not landed
        self.failed: DjinnError | None = None  # Note [failed values]
        self.rng: torch.Tensor | None = None
        self.draw: Any = None  # how its random op advanced the local generator (seeded.Draw)
        self.module = ""
        self.specs: Any = None
        # the values of the bases of the views this op writes into (Note [failed values])
        self.bases: tuple[Any, ...] = ()
        # the ``Storage`` marks of what it writes into, shared with their views (Note
        # [a failed write's views], failures.py)
        self.storages: tuple[Storage, ...] = ()

    @property
    def name(self) -> str:
        return f"{self.op._schema.name}.{self.op._overloadname}"


REPLAY = object()  # the op of every Replayed node: no schema, so it writes into nothing


class Replayed(Node):
    """A replayed call's graph sent as one (Note [asynchronous replays], replay_run.py):
    output ``k`` is the graph's ``k``-th kept value; ``bases`` are the values it writes
    into, which hold its error if it fails."""

    __slots__ = ("label",)

    def __init__(self, label: str, trace: Trace, nout: int, writes: tuple[Any, ...]) -> None:
        super().__init__(REPLAY, (), {}, trace, nout, multi=True)
        self.label = label
        self.bases = writes

    @property
    def name(self) -> str:
        return self.label


class Pending:
    """Output ``index`` of a node (index 0 for single-output ops)."""

    __slots__ = ("index", "node")

    def __init__(self, node: Node, index: int) -> None:
        self.node = node
        self.index = index


class Uninit:
    """An allocation (``empty``) not yet used: materialised only if something reads it."""

    __slots__ = ("spec",)

    def __init__(self, spec: Any) -> None:
        self.spec = spec  # a meta.TensorSpec


class Binding:
    """What one LazyTensor stands for (its ``_ref``), in a cell of its own.

    Note [bindings]: a flush keeps on the appliance the pending outputs somebody still
    holds, and points the holders at the kept handles. Nodes knew their holders through
    weak references to the tensors themselves, and a tensor with a weak reference cannot
    be swapped (``torch.utils.swap_tensors``), which is how ``Module._apply`` moves a
    parameter onto a wrapper subclass's device while keeping its identity, the identity an
    optimizer built before ``model.to(remote)`` holds (Note [parameters keep their
    identity], ties.py). So the tensor holds its value through a ``Binding`` in its
    ``__dict__``: nodes hold the binding weakly, and a swap carries it, with the
    ``__dict__``, to the tensor that now stands for the value. Binding again (``.data =``,
    an in-place rebind) makes a new cell, so the old one dies and its node no longer counts
    that tensor."""

    __slots__ = ("__weakref__", "ref", "storage")

    def __init__(self, ref: Any, storage: Storage | None = None) -> None:
        self.ref = ref
        # shared by a tensor and the views made of it, once one is (Note [writes another
        # thread captured], writes.py)
        self.storage = storage


_ADDRESSES = itertools.count(1)


class Storage:
    """The storage a tensor and its views share, as far as writes are concerned: the node
    that last wrote into any of them (Note [writes another thread captured], writes.py).
    Held by the cells, not the other way: a base cell kept alive by its views would count
    as a holder of its node's output (Note [bindings])."""

    __slots__ = ("address", "failed", "reader", "writer", "written")

    def __init__(self) -> None:
        # what data_ptr() says of it on the client: a number of its own, 2**40 apart from
        # any other's, never memory (Note [remote storages], shared_copies.py)
        self.address = next(_ADDRESSES) << 40
        self.writer: Node | None = None
        # the trace that last captured an op taking any of them (Note [reads another
        # thread captured], writes.py)
        self.reader: Any = None
        # once anything wrote into it: a value the client kept of it no longer holds
        # (Note [values the client knows], known.py)
        self.written = False
        # the error of a write into it that failed: every tensor sharing it raises it
        # when read (Note [a failed write's views], failures.py)
        self.failed: DjinnError | None = None


class HostTensor:
    """A small CPU tensor an op wants on the host, not on its device (the ``scalars`` of
    ``_foreach_addcdiv.Tensor``, as on CUDA): sent inline and never moved to the device."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def held(ref: Any, remote: Any) -> None:
    """A requested output that came back is its node's result, as a held one is: nothing
    holds ``_run_now``'s own outputs yet, and ``resolved`` would call them released (a
    failure elsewhere in the graph turned an op that ran fine into an INTERNAL error)."""
    if isinstance(ref, Pending) and isinstance(remote, RemoteTensor) and ref.node.executed:
        results = ref.node.results
        if results is not None and ref.node.failed is None and results[ref.index] is None:
            results[ref.index] = remote


# snapshot clones of small integer tensors (an attention mask moved while a trace held
# ops): the copy and the ``Storage`` mark that their kept handle gets as its known value
# once sent (Note [values the client knows], known.py)
KNOWN_CLONES: weakref.WeakKeyDictionary[Node, tuple[torch.Tensor, Storage]] = (
    weakref.WeakKeyDictionary()
)


def ran(sent: list[Node], keep_targets: list, kept: list[Any], failure: Any) -> None:
    """The nodes the appliance ran are executed; the kept ones now name their handles.

    Note [results before executed]: other threads read a node's ``executed`` and
    ``results`` without a lock (``resolved``, ``ref_for_node``). A node marked executed
    before its kept results were in place read as "released before it was read" on a
    thread that looked in between (a trainer reading its momentum buffers while another
    thread landed the graph that made them: 2 errors in about 7,400 steps). So each node's
    results are complete before it is marked executed."""
    ran = sent if failure is None else sent[: failure["node"]]
    results = {id(n): [None] * n.nout for n in ran}
    for (n, k, _alive), remote in zip(keep_targets, kept, strict=False):
        if remote is not None:
            results[id(n)][k] = remote
    # what the rest of a failed graph reads, nothing else held (the appliance's Note
    # [values the rest reads]): it runs again reading these, and they go with its nodes
    for ref, remote in failure.get("held", ()) if failure is not None else ():
        results[id(sent[ref["$v"]])][ref.get("i", 0)] = remote
    for n in ran:
        n.results = results[id(n)]
        n.executed = True
        n.args = n.kwargs = None  # let inputs go
        n.rng = n.draw = None
        n.bases = n.storages = ()
    for (n, _k, alive), remote in zip(keep_targets, kept, strict=False):
        if remote is not None:
            if KNOWN_CLONES and n in KNOWN_CLONES:
                remote.known = KNOWN_CLONES.pop(n)
            for cell in alive:
                cell.ref = remote
                if cell.storage is not None:  # Note [a failed write's views] (failures.py)
                    remote.storage = cell.storage
