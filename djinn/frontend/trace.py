"""The per-thread trace of captured ops and how it is shipped to the appliance.

Ops are recorded in *program order* and executed remotely in that same order, so
in-place ops, views and ``out=`` arguments behave exactly as in eager PyTorch: the worker
holds real tensors with real aliasing and applies the same mutations in the same order.
A flush ships every pending node once; outputs that a live LazyTensor still refers to
are kept on the appliance as handles (so nothing is ever recomputed), everything else is
dropped after its last use, and only the values being read come back.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import TYPE_CHECKING, Any

import torch

from djinn.errors import DjinnError, ExecutionError
from djinn.protocol.tensors import to_wire
from djinn.protocol.values import NOT_A_CONSTANT, encode
from djinn.runtime.remote import RemoteTensor

if TYPE_CHECKING:
    from .lazy import LazyTensor


class Node:
    """One captured aten call. ``args``/``kwargs`` hold refs, never LazyTensors, so a
    pending graph does not keep user tensors alive."""

    __slots__ = (
        "__weakref__",
        "args",
        "executed",
        "failed",
        "holders",
        "kwargs",
        "module",
        "multi",
        "nout",
        "op",
        "results",
        "rng",
        "specs",
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
        self.holders: list[list[weakref.ref]] = [[] for _ in range(nout)]
        self.results: list[RemoteTensor | None] | None = None
        self.executed = False
        self.failed: DjinnError | None = None  # Note [failed values]
        self.rng: torch.Tensor | None = None
        self.module = ""
        self.specs: Any = None

    @property
    def name(self) -> str:
        return f"{self.op._schema.name}.{self.op._overloadname}"


class HostTensor:
    """A small CPU tensor an op wants on the host, not on its device (the ``scalars`` of
    ``_foreach_addcdiv.Tensor``, as on CUDA): sent inline and never moved to the device."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class Failed:
    """The value of an op that failed, or that depended on one (Note [failed values]).

    Note [failed values]: an op that fails leaves its own outputs, and the outputs of
    everything computed from them, holding the error; reading one raises it, naming the
    op. Every other tensor in the thread stays usable: a failure never stays in the trace
    to fail the next flush too, and never surfaces as "released before it was read".
    """

    __slots__ = ("error",)

    def __init__(self, error: DjinnError) -> None:
        self.error = error


def failed_error(op_name: str, exc: BaseException) -> DjinnError:
    """``exc`` as the typed error a value computed by ``op_name`` raises when used."""
    if isinstance(exc, DjinnError):
        err = type(exc)(f"{op_name}: {exc.message}" if op_name not in exc.message else exc.message)
        err.code = exc.code
    else:
        err = ExecutionError(f"{op_name} failed: {type(exc).__name__}: {exc}")
    err.__cause__ = exc
    return err


class Pending:
    """Output ``index`` of a node (index 0 for single-output ops)."""

    __slots__ = ("index", "node")

    def __init__(self, node: Node, index: int) -> None:
        self.node = node
        self.index = index


class Trace:
    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self.lock = threading.RLock()
        self.recorders: list[Any] = []  # djinn.capture() blocks building an SRG
        self.backward_task = -1  # graph task whose end flushes this trace

    def _after_backward(self) -> None:
        self.backward_task = -1
        with contextlib.suppress(DjinnError):  # failed nodes hold it: a gradient read raises
            flush(self)

    def add(self, node: Node) -> None:
        with self.lock:  # another thread may be flushing this trace (cross-thread reads)
            self.nodes.append(node)
        task = torch._C._current_graph_task_id()
        if task != -1 and self.backward_task != task:
            # Note [flush after backward]: backward() runs on the autograd engine's
            # thread, whose trace no one else reads unless a gradient is. Gradients
            # dropped unread (zero_grad(set_to_none=True)) would leave their nodes, and
            # every input those hold, pending forever. Run them when backward ends.
            self.backward_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)
        recorders = self.recorders
        if not recorders and AUTOGRAD_RECORDERS and task != -1:
            # backward() of remote tensors runs on PyTorch's device thread, not the thread
            # that captured the forward: attribute its ops to the open capture blocks.
            recorders = AUTOGRAD_RECORDERS
        for recorder in recorders:
            recorder.on_node(node)


_local = threading.local()
AUTOGRAD_RECORDERS: list[Any] = []  # capture blocks open in any thread (see Trace.add)


def current() -> Trace:
    trace = getattr(_local, "trace", None)
    if trace is None:
        trace = _local.trace = Trace()
    return trace


def bind(lazy: LazyTensor, ref: Any) -> None:
    """Point a LazyTensor at a value; a pending value learns it has a live holder."""
    lazy._ref = ref
    if isinstance(ref, Pending):
        ref.node.holders[ref.index].append(weakref.ref(lazy))


def resolved(ref: Any) -> Any:
    """A pending ref whose node already ran elsewhere becomes its kept handle; a failed
    value raises its error (Note [failed values])."""
    if isinstance(ref, Failed):
        raise ref.error
    if isinstance(ref, Pending) and ref.node.failed is not None:
        raise ref.node.failed
    if isinstance(ref, Pending) and ref.node.executed:
        results = ref.node.results or []
        value = results[ref.index] if ref.index < len(results) else None
        if value is None:
            raise DjinnError(f"{ref.node.name}: its value was released before it was read")
        return value
    return ref


class _Encoder:
    def __init__(self, nodes: list[Node]) -> None:
        self.index = {id(n): i for i, n in enumerate(nodes)}
        self.inline: list[torch.Tensor] = []
        self._inline_ids: dict[int, int] = {}

    def ref(self, ref: Any) -> Any:
        ref = resolved(ref)
        if isinstance(ref, Pending):
            i = self.index.get(id(ref.node))
            if i is None:
                raise DjinnError(f"{ref.node.name}: captured in another trace that was not run")
            return {"$v": i, "i": ref.index} if ref.node.multi else {"$v": i}
        if isinstance(ref, RemoteTensor):
            return {"$h": ref.handle}
        raise TypeError(ref)

    def tensor(self, t: torch.Tensor) -> dict[str, Any]:
        desc, _ = to_wire(t)  # refuses what cannot be sent before anything is recorded
        k = self._inline_ids.get(id(t))
        if k is None:
            k = self._inline_ids[id(t)] = len(self.inline)
            self.inline.append(t)
        return {"$t": k, "desc": desc}

    def rollback(self, mark: int) -> None:
        """Forget the inline tensors added since ``len(self.inline)`` was ``mark``."""
        for t in self.inline[mark:]:
            self._inline_ids.pop(id(t), None)
        del self.inline[mark:]

    def value(self, x: Any) -> Any:
        return encode(x, self._leaf)

    def _leaf(self, x: Any) -> Any:
        if isinstance(x, (Pending, RemoteTensor)):
            return self.ref(x)
        if isinstance(x, torch.Tensor):
            return self.tensor(x)
        if isinstance(x, HostTensor):
            return {**self.tensor(x.tensor), "host": True}
        return NOT_A_CONSTANT

    def node(self, n: Node) -> dict[str, Any]:
        out: dict[str, Any] = {"op": n.name, "args": self.value(n.args)}
        if n.kwargs:
            out["kwargs"] = self.value(n.kwargs)
        if n.rng is not None:
            out["rng"] = self.tensor(n.rng)["$t"]
        return out


def flush(
    trace: Trace, fetch: list[Any] = (), keep: list[Any] = ()
) -> tuple[list[Any], list[RemoteTensor]]:
    """Run every pending node of ``trace``. Returns the values of the ``fetch`` refs and
    handles for the ``keep`` refs (outputs live LazyTensors hold are kept regardless).

    A node that cannot be sent (or depends on one that failed) fails alone and the rest
    run (Note [failed values]); if a requested ref is among the failed, its error is
    raised after the others ran. If the appliance refuses the batch, every node in it
    fails with the appliance's error, and that error is raised."""
    from .session import default_session

    with trace.lock:
        nodes, trace.nodes = trace.nodes, []
        if not nodes and not fetch and not keep:
            return [], []
        enc = _Encoder([])
        encoded: list[dict[str, Any]] = []
        sent: list[Node] = []
        for n in nodes:
            mark = len(enc.inline)
            try:
                item = enc.node(n)
            except DjinnError as exc:
                enc.rollback(mark)  # the failed node's inline tensors are not sent
                _fail(n, exc if _is_dependency_error(exc, n) else failed_error(n.name, exc))
                continue
            enc.index[id(n)] = len(encoded)
            encoded.append(item)
            sent.append(n)
        keep_refs, keep_targets = [], []
        for i, n in enumerate(sent):
            for k in range(n.nout):
                alive = [
                    lz
                    for w in n.holders[k]
                    if (lz := w()) is not None
                    and isinstance(lz._ref, Pending)
                    and lz._ref.node is n
                ]
                if alive:
                    keep_refs.append({"$v": i, "i": k} if n.multi else {"$v": i})
                    keep_targets.append((n, k, alive))
        requested: Exception | None = None
        try:
            fetch_refs = [enc.ref(r) for r in fetch]
            extra = [enc.ref(r) for r in keep]
        except DjinnError as exc:
            requested, fetch_refs, extra = exc, [], []
        fetched: list[Any] = []
        kept: list[Any] = []
        if encoded or fetch_refs or extra:
            try:
                kept, fetched = default_session().execute(
                    encoded, keep=keep_refs + extra, fetch=fetch_refs, inline=enc.inline
                )
            except DjinnError as exc:
                for n in sent:
                    _fail(n, exc)
                raise
            finally:
                for n in sent:
                    n.executed = True
                    n.results = [None] * n.nout
                    n.args = n.kwargs = None  # let inputs go
                    n.rng = None
        for (n, k, alive), remote in zip(keep_targets, kept, strict=False):
            n.results[k] = remote
            for lz in alive:
                lz._ref = remote
        if requested is not None:
            raise requested
        return fetched, kept[len(keep_targets) :]


def _is_dependency_error(exc: DjinnError, node: Node) -> bool:
    """Whether ``exc`` is the failure of one of ``node``'s inputs (passed on as is)."""
    return getattr(exc, "_djinn_failed_value", False)


def _fail(node: Node, error: DjinnError) -> None:
    """Note [failed values]: the node's outputs hold ``error`` from now on."""
    error._djinn_failed_value = True  # type: ignore[attr-defined]
    node.failed = error
    node.executed = True
    node.results = [None] * node.nout
    node.args = node.kwargs = None
    node.rng = None
    failed = Failed(error)
    for holders in node.holders:
        for w in holders:
            lz = w()
            if lz is not None and isinstance(lz._ref, Pending) and lz._ref.node is node:
                lz._ref = failed
