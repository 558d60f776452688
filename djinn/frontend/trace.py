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

from djinn.errors import DjinnError, copy_of
from djinn.protocol.tensors import to_wire
from djinn.protocol.values import NOT_A_CONSTANT, encode
from djinn.runtime.remote import RemoteTensor

from . import inflight, interrupts, partial
from .failures import (
    Failed,
    fail,
    failed_error,
    is_dependency_error,
    written_args,
)
from .inflight import _INFLIGHT, _INFLIGHT_LOCK, Sent, _not_run, land, land_all
from .nodes import Binding, HostTensor, Node, Pending, Storage, held, ran

if TYPE_CHECKING:
    from .lazy import LazyTensor


# Note [followed steps] (replay_follow.py): how many threads follow optimizer steps now,
# a cheap check on the paths that must stop one first; and what a follower answers for an
# op it does not follow (capture it)
FOLLOWING = 0
FOLLOWING_LOCK = threading.Lock()
MISSED = object()


def stop_following(why: str) -> None:
    """Stop this thread's following of its steps, if it follows any (Note [followed
    steps]): what it followed is captured first."""
    follower = current().follower
    if follower is not None:
        follower.abort(why)


class Trace:
    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self.lock = threading.RLock()
        self.recorders: list[Any] = []  # djinn.capture() blocks building an SRG
        self.backward_task = -1  # graph task whose end flushes this trace
        self.chunk_ops = _chunk_ops()  # Note [streamed graphs]; 0: never streamed
        # while a replayable function records: handle -> (the Binding, the tensor) of each
        # remote tensor its ops read (Note [replayable functions])
        self.reads: dict[str, Any] | None = None
        self.follower: Any = None  # a replay following its steps (replay_follow.py)
        self.recording = 0  # a replayable call recording here, until its graph is sent
        # while it records: the values it read that the client computed (known.Program),
        # which its replays check again (Note [values the client knows], known.py)
        self.guards: list[Any] | None = None
        # Note [failures raised on their thread]: whose ops these are (None: an autograd
        # engine thread's, whose failures are raised where they land), and the failures
        # another thread landed for it, raised at its next flush
        # an autograd engine device thread (one Python did not start) in a backward pass;
        # not a thread whose first remote op ran in a CPU backward on it (a hook: a review)
        engine = torch._C._current_graph_task_id() != -1 and isinstance(
            threading.current_thread(), threading._DummyThread
        )
        self.owner: int | None = None if engine else threading.get_ident()
        self.failures: list[DjinnError] = []
        # its nodes are taken and not sent yet: a writer elsewhere waits for them (Note
        # [reads another thread captured], writes.readers_sent)
        self.sending = False

    def read(self, name: Any, x: torch.Tensor) -> None:
        """Note [replayable functions]: a tensor a recording read, under its handle (a CPU
        tensor under its id), with its Binding; each distinct tensor of one handle once."""
        cell = x.__dict__.get("_b")
        entries = self.reads.setdefault(name, [])
        if all(c is not cell or t is not x for c, t in entries):
            entries.append((cell, x))

    def _after_backward(self) -> None:
        self.backward_task = -1
        land_all()  # graphs this backward pass sent: their errors are backward()'s
        with contextlib.suppress(DjinnError):  # failed nodes hold it: a gradient read raises
            flush(self, wait=False, quiet=True)

    # Note [a node and its outputs]: another thread that reads a tensor this trace holds
    # sends the trace (Note [asynchronous flushes]), and a flush keeps the outputs that
    # live tensors hold (``Node.holders``). An op joins the trace before its outputs are
    # bound to their tensors, so a flush between the two ran the node with nothing holding
    # its output, and that output then read as "released before it was read" (seen with a
    # trainer thread and a thread reading ``.grad``). So whoever adds a node holds the
    # trace's lock, which a flush takes, until the node's outputs are bound; nothing in
    # between may wait for another trace (``flush`` of another trace, a fetch). An op run
    # at once (``immediate._run_now``: a value-dependent shape, a Python result) joins the trace
    # inside the flush that runs it (``flush(add=...)``), after that flush has landed what
    # is in flight, which takes other traces' locks.
    def add(self, node: Node) -> None:
        if self.follower is not None:  # Note [followed steps]: what it followed goes first
            self.follower.abort("an op was captured another way (a tensor made in place)")
        with self.lock:  # another thread may be flushing this trace (cross-thread reads)
            self.nodes.append(node)
        task = torch._C._current_graph_task_id()
        # a recording (Note [replayable functions]) flushes its backward with the rest
        if task != -1 and self.backward_task != task and self.reads is None:
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


def _chunk_ops() -> int:
    from djinn import config

    return int(config.load().graph_chunk_ops)


# -- Note [streamed graphs] -----------------------------------------------------------------
# A thread that captures a long run of ops without reading a value (a model's forward, a
# loop that only ever writes) sends every `graph_chunk_ops` ops as a graph of their own,
# without waiting (Note [asynchronous flushes]). Without it a loop that never reads built
# one unbounded graph, and past the appliance's 100,000 ops a graph it failed as a whole
# (INVALID_ARGUMENT) when a value was finally read. The cut is made before an op is
# captured, never inside one: every earlier op's outputs are bound to their LazyTensors by
# then, so what is still alive (the residual stream, the current op's arguments) is kept as
# a handle, exactly as at any `.item()`. Counting restarts at every flush, so a loop cuts
# at the same ops each time and its parts repeat as cached templates.
# Why the default (4096) leaves a model's forward whole: cutting lets the worker run one
# part while the client captures the next, but on a CPU worker sharing the client's cores
# the overlap loses to the contention and extra round trips (benchmarks/capture.py, GPT-2
# 12 layers, 807 ops: one graph 1.46x local; cut every 400 ops 1.55x, 64 1.89x, 16 1.98x).
def stream(trace: Trace) -> None:
    """Send what ``trace`` captured so far, without waiting (Note [streamed graphs])."""
    flush(trace, wait=False)


_local = threading.local()  # .trace; .observer: the graph a flush sends while a replayable
# function records (Note [replayable functions]): it may return the graph's template form
AUTOGRAD_RECORDERS: list[Any] = []  # capture blocks open in any thread (see Trace.add)


# Note [replayable functions]: (thread id, trace) while a replayable function records.
# The backward pass it runs executes on PyTorch's device thread while the recording thread
# waits in backward(): that thread's ops join the recording's graph, in program order.
RECORDING: tuple[int, Trace] | None = None


def current() -> Trace:
    rec = RECORDING
    if (
        rec is not None
        and rec[0] != threading.get_ident()
        and torch._C._current_graph_task_id() != -1
    ):
        return rec[1]
    trace = getattr(_local, "trace", None)
    if trace is None:
        trace = _local.trace = Trace()
    return trace


def bind(lazy: LazyTensor, ref: Any, storage: Storage | None = None) -> None:
    """Point a LazyTensor at a value (in a ``storage`` its views share, if given); a
    pending value learns it has a live holder (Note [bindings])."""
    cell = lazy.__dict__["_b"] = Binding(ref, storage)
    if isinstance(ref, Pending):
        ref.node.holders[ref.index].append(weakref.ref(cell))


def reported(error: BaseException) -> BaseException:
    """The copy of ``error``, a failure a value holds, to raise on this thread; the same
    failure kept for this thread (Note [failures raised on their thread]) is not raised
    again at its next flush: the read raised it (a review: a thread read its singular
    inverse, then its next read of an unrelated value raised the error a second time)."""
    trace = getattr(_local, "trace", None)
    origin = getattr(error, "_djinn_origin", None)
    if trace is not None and trace.failures and origin is not None:
        trace.failures[:] = [
            e for e in trace.failures if getattr(e, "_djinn_origin", 0) is not origin
        ]
    return copy_of(error)


def resolved(ref: Any) -> Any:
    """A pending ref whose node already ran elsewhere becomes its kept handle; a failed
    value raises its error (Note [failed values])."""
    if isinstance(ref, Failed):
        raise reported(ref.error)
    if isinstance(ref, RemoteTensor) and ref.failed is not None:
        raise reported(ref.failed)
    if isinstance(ref, Pending) and ref.node.failed is not None:
        raise reported(ref.node.failed)
    if isinstance(ref, Pending) and ref.node.executed:
        results = ref.node.results or []
        value = results[ref.index] if ref.index < len(results) else None
        if value is None:
            if ref.node.failed is not None:  # failed on another thread since the check above
                raise reported(ref.node.failed)
            raise DjinnError(f"{ref.node.name}: its value was released before it was read")
        if value.failed is not None:
            raise reported(value.failed)
        return value
    return ref


_REFS = (RemoteTensor, Pending)


class _Encoder:
    def __init__(self, nodes: list[Node], session: Any = None) -> None:
        self.session = session  # where the graph goes: handles must live there
        self.index = {id(n): i for i, n in enumerate(nodes)}
        self.inline: list[torch.Tensor] = []
        self._inline_ids: dict[int, int] = {}

    def ref(self, ref: Any) -> Any:
        if type(ref) is not RemoteTensor or ref.failed is not None:  # a live handle as is
            if isinstance(ref, Pending) and ref.node.inflight is not None:
                land(ref.node.inflight)
            ref = resolved(ref)
        if isinstance(ref, Pending):
            i = self.index.get(id(ref.node))
            if i is None:
                raise DjinnError(f"{ref.node.name}: captured in another trace that was not run")
            return {"$v": i, "i": ref.index} if ref.node.multi else {"$v": i}
        if isinstance(ref, RemoteTensor):
            if self.session is not None and ref.session is not self.session:
                raise _elsewhere(ref)
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
        if type(x) is list:  # a node's arguments: its tensor lists (foreach ops) go flat
            return [self._refs(v) if type(v) is list else encode(v, self._leaf) for v in x]
        return encode(x, self._leaf)

    def _refs(self, xs: list[Any]) -> list[Any]:
        """A list argument: the refs of an optimizer step's tensor lists are most of what
        a ``_foreach_*`` node encodes, one ``ref`` each without ``encode``'s walk."""
        return [self.ref(x) if type(x) in _REFS else encode(x, self._leaf) for x in xs]

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


def _elsewhere(ref: RemoteTensor) -> DjinnError:
    """A tensor of a session other than the one the graph goes to: Note [session after
    loss] (session.py), its session is gone and new work went to a new one."""
    from djinn.errors import InvalidArgument, SessionLost

    old = ref.session
    if getattr(old, "usable", True):
        return InvalidArgument("a tensor of another session cannot join this graph")
    if old._gone is not None:  # ended by an operator, or expired: say so, as it said
        return type(old._gone)(f"this tensor's session is gone: {old._gone.message}")
    why = old._lost or "it was closed"
    return SessionLost(f"this tensor was held by session {old.id}, which is gone ({why})")


# Note [buffers under torch.func]: inside a ``torch.func`` transform (``jacfwd``,
# ``vmap``, ``hessian``) every tensor a factory makes is functorch's, with no storage, the
# client's own buffers too: a flush that cut the journal there (Note [lineage truncation])
# read its reply into such a buffer, raised "Cannot access data pointer of Tensor that
# doesn't have storage" halfway through a frame, and lost the session (a review,
# ``hessian`` of a remote function). The client's plumbing is no part of what the
# program differentiates or maps, so a flush runs, and makes its buffers, with functorch
# off.
def flush(
    trace: Trace,
    fetch: list[Any] = (),
    keep: list[Any] = (),
    *,
    wait: bool = True,
    quiet: bool = False,
    add: Node | None = None,
    unless_recording: bool = False,
) -> tuple[list[Any], list[RemoteTensor]]:
    """Run every pending node of ``trace``. Returns the values of the ``fetch`` refs and
    handles for the ``keep`` refs (outputs live LazyTensors hold are kept regardless).
    ``wait=False`` with nothing requested: send the graph and return at once (Note
    [asynchronous flushes]); ``quiet``: its failure is not raised when it lands. ``add``:
    a node that joins the trace as the flush takes it, whose outputs ``fetch`` and
    ``keep`` name (Note [a node and its outputs]: another thread's flush could otherwise
    send it in between, with nothing holding them).

    Note [failed values] in practice: a node that cannot be sent, or that the appliance
    refuses, fails alone, with everything computed from it (and what it would have
    written into); every independent node runs, in program order. If a requested ref is
    among the failed, its error is raised once the others ran."""
    with torch._C._DisableFuncTorch():  # Note [buffers under torch.func]
        if trace.follower is not None:  # Note [followed steps]: a read stops the following
            trace.follower.abort("its steps read a value")
        land_all()  # what this graph reads may be what a graph in flight makes
        if trace.failures and not quiet and trace.owner == threading.get_ident():
            error = trace.failures.pop(0)  # Note [failures raised on their thread]
            if add is not None:
                fail(add, error)  # not run, as in eager: the error came first
            raise copy_of(error)
        # a first Ctrl-C is raised once the nodes it takes are sent, or landed (Note
        # [interrupted waits]): encoding them may land another thread's graph (a review)
        with trace.lock, interrupts.deferred():
            if unless_recording and trace.recording:  # Note [writes another thread captured]
                return [], []
            # set before the nodes are taken, and put back as it was: a flush nested in this
            # one (_after_failure's, as a graph of this trace lands) must not clear it while
            # this one still holds nodes (a review)
            was, trace.sending = trace.sending, True
            try:
                if add is not None:
                    trace.add(add)
                nodes, trace.nodes = trace.nodes, []
                if not nodes and not fetch and not keep:
                    return [], []
                return _send(trace, nodes, fetch, keep, wait, quiet)
            finally:
                trace.sending = was


def _send(
    trace: Trace, nodes: list[Node], fetch: list[Any], keep: list[Any], wait: bool, quiet: bool
) -> tuple[list[Any], list[RemoteTensor]]:
    """``flush``'s work once it took ``trace``'s nodes, under its lock."""
    from .session import default_session

    enc = _Encoder([], default_session())
    encoded: list[dict[str, Any]] = []
    sent: list[Node] = []
    for n in nodes:
        if n.failed is not None:
            continue  # failed while waiting (it wrote into what a failed op produced)
        mark = len(enc.inline)
        try:
            item = enc.node(n)
        except DjinnError as exc:
            enc.rollback(mark)  # the failed node's inline tensors are not sent
            fail(n, exc if is_dependency_error(exc) else failed_error(n.name, exc))
            continue
        enc.index[id(n)] = len(encoded)
        encoded.append(item)
        sent.append(n)
    keep_refs, keep_targets = [], []
    for i, n in enumerate(sent):
        for k in range(n.nout):
            alive = [
                cell
                for w in n.holders[k]
                if (cell := w()) is not None
                and isinstance(cell.ref, Pending)
                and cell.ref.node is n
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
        fetch, keep = [], []
    if not wait and encoded and not fetch_refs and not extra and requested is None:
        item = Sent(trace, sent, keep_targets, quiet)
        try:
            item.flight = default_session().run_graph_async(encoded, keep_refs, enc.inline)
        except (DjinnError, KeyboardInterrupt) as exc:
            _not_run(sent, exc)
            raise
        for n in sent:
            n.inflight = item
        with _INFLIGHT_LOCK:
            _INFLIGHT.append(item)
        return [], []
    fetched: list[Any] = []
    kept: list[Any] = []
    failure = None
    observer = getattr(_local, "observer", None)  # Note [replayable functions]
    form = None  # the template's (fingerprint, inputs, scalars), if the observer made it
    if observer is not None:
        form = observer(encoded, keep_refs + extra, fetch_refs, enc.inline, keep_targets)
    if encoded or fetch_refs or extra:
        try:
            kept, fetched, failure = default_session().run_graph(
                encoded, keep=keep_refs + extra, fetch=fetch_refs, inline=enc.inline,
                form=form,
            )  # fmt: skip
        except (DjinnError, KeyboardInterrupt) as exc:  # nothing is known to run
            _not_run(sent, exc)
            raise
    ran(sent, keep_targets, kept, failure)
    kept = kept[len(keep_targets) :]
    for ref, remote in zip(keep, kept, strict=False):
        held(ref, remote)
    if failure is not None:
        fetched, kept = _after_failure(trace, sent, failure, fetch, keep, fetched, kept)
    if requested is not None:
        raise requested
    return fetched, kept


def _after_failure(
    trace: Trace,
    sent: list[Node],
    failure: dict[str, Any],
    fetch: list[Any],
    keep: list[Any],
    fetched: list[Any],
    kept: list[Any],
) -> tuple[list[Any], list[Any]]:
    """The appliance ran ``sent`` up to the failed node: what failed fails
    (``partial.settle``), the independent rest goes back in front of the trace and runs,
    with the requested values that did not run yet, or that a write still to run could
    change; then a failed check raises."""
    from djinn.runtime.session import NOT_RUN

    again, raise_now = partial.settle(sent, failure)
    trace.nodes = again + trace.nodes
    writes = any(written_args(n.op) for n in again)
    redo_f = [j for j, v in enumerate(fetched) if v is NOT_RUN or writes]
    redo_k = [j for j, v in enumerate(kept) if v is None or writes]
    more_f, more_k = flush(trace, [fetch[j] for j in redo_f], [keep[j] for j in redo_k])
    fetched, kept = list(fetched), list(kept)
    for j, v in zip(redo_f, more_f, strict=True):
        fetched[j] = v
    for j, v in zip(redo_k, more_k, strict=True):
        kept[j] = v
    for ref in (*fetch, *keep):
        resolved(ref)  # a requested value an op failed to write into raises
    if raise_now is not None:
        raise copy_of(raise_now)
    return fetched, kept


inflight.attach(_after_failure)
