"""What a captured op writes into: the bases of the views it writes (Note [failed
values]), and which node, on which thread's trace, holds a write into a handle (Note
[writes another thread captured]).

Note [writes another thread captured]: an op captured on one thread that writes into a
tensor bound to a handle (an optimizer's step into the parameters) leaves it bound to that
handle, the write pending in that thread's trace. A read of the handle on another thread
fetched the value without it: a model trained on a thread and read on the main one came
back a step behind (a review, 2026-11-27: every parameter 4e-3 to 1e-2 off local
eager's), and a thread that ended without a read never sent its last step at all. So the
handle names the node that last wrote into it (``record_writes``), and a read elsewhere sends
that node's trace first while the node is not sent (``writes_sent``), as a read of
another thread's pending value does (``lazy.ref_for_node``). The session runs its
requests in the order they are sent, so the read sees the write.

Handles can share storage: a view read back has a handle of its own (``w[1].cpu()``), and
so does each of two views of one base. A write into one of them is a write into the
others, so a tensor and the views made of it share a ``Storage`` mark (nodes.py), made
when the first view is captured (``shared_storage``): a write marks it as well as the
handle, and a read looks at both. A review found three such reads wrong after the first
fix: a view read after its base was written on a thread, a sibling view read after the
other was, and a base read after ``_foreach_add_`` wrote into views of it. The mark lives
in the cells rather than linking a view's cell to its base's: a base cell kept alive by
its views counts as a holder of its node's output (Note [bindings]), and a gradient that
is a view (``t()``) of an ``mm`` made every recording of a training step fail with "it
keeps a tensor it made". A replay's outputs are new tensors: one that was a view when
recorded gets the ``Storage`` of the argument it is a view of, or the recorded one
(``Record.shares``, replay_outputs.bind_outputs).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from djinn.runtime.remote import RemoteTensor

from .failures import written_args, written_values
from .nodes import Node, Pending, Storage
from .trace import Trace, flush


def writes_sent(ref: RemoteTensor | Storage, trace: Trace) -> None:
    """Send the trace holding the last write captured into ``ref`` (a handle, or a
    ``Storage`` views share), if that write is another thread's and not sent yet. The
    node, not its trace, is what the handle names: naming the trace flushed whatever
    that thread was capturing at every read, long after the write had gone (a review: a
    thread polling a parameter every ms cut a replayable trainer's every recording
    short, 0 replays in 100 calls against 97)."""
    node = ref.writer
    if node is None:
        return
    if node.executed or node.inflight is not None or node.failed is not None:
        ref.writer = None  # sent: the session runs it before anything read after it
    elif node.trace is not trace:
        # not while a replayable call records there (decided under the trace's lock, as
        # the recording starts under it): a read racing a call that has not returned may
        # see the value from before it, as in eager, and once the call returns its
        # recording has sent the write; cut short, it would never replay
        flush(node.trace, wait=False, unless_recording=True)


def mark_read(obj: RemoteTensor | Storage, trace: Trace) -> None:
    """``trace`` captured an op taking ``obj``, a handle or a ``Storage`` views share
    (Note [reads another thread captured]). Other readers whose ops may still be pending
    stay with it: the write's own thread reads the tensor too (``u[0] = 0`` takes ``u``
    in its ``select``) before it writes."""
    old = obj.reader
    if old is None or old is trace:
        obj.reader = trace
        return
    if type(old) is tuple and old[-1] is trace:
        return  # two threads reading one tensor: not rebuilt at each op (0.8 µs)
    keep = tuple(
        t
        for t in (old if type(old) is tuple else (old,))
        if t is not trace and (t.nodes or t.sending)
    )
    obj.reader = (*keep, trace) if keep else trace


def mark_taken(x: Any, ref: Any, trace: Trace) -> None:
    """``mark_read`` for what ``ref_for_node`` found past its common cases: a handle
    another thread's value became, or a value still pending on another thread, or in
    flight (a review: a write elsewhere overtook such a read, ``[1, 1, 1, 1]`` where eager
    gives ``[2, 2, 2, 2]``). A pending value has no handle to mark yet: its tensor's
    ``Storage`` is marked, which stays with the cell once the handle is bound to it."""
    if type(ref) is RemoteTensor:
        mark_read(ref, trace)
    elif type(ref) is Pending and (ref.node.trace is not trace or ref.node.inflight is not None):
        mark_read(shared_storage(x), trace)


def readers_sent(reader: Any, trace: Trace) -> None:
    """Note [reads another thread captured]: an op another thread captured that takes a
    tensor and is not sent yet must run before a write into the tensor captured now, on
    ``trace``, as it ran before it in eager. Without this, the write's thread sent it
    first at its next read, and the other thread's ``u.long()``, captured before
    ``u[0] = 0``, came back with the write in it (a review). So the traces of the ops
    that took it (``reader``: one, or a tuple, ``mark_read``) are sent first, as
    ``writes_sent`` sends a write's trace before another thread's read. Not while a
    replayable call records there: a write racing a call that has not returned may land
    inside it, as in eager. A reader that took its nodes and is sending them (``sending``)
    is waited for: its lock is held until they are sent (a review found a write going
    first in that window, forced).

    Every route a write takes names what it writes first (a second review found four
    that did not, each a wrong number): a captured op (``record_writes``), one run at once
    (``immediate._run_now``: ``SGD(fused=True)``'s step), a replay's writes and a followed
    step's (``readers_sent_into``). And every route a read takes is marked: a handle, a
    value pending on another thread or in flight (``mark_taken``), and the ``Storage`` a
    tensor's first view makes, which starts with the tensor's readers."""
    if reader is None or reader is trace:
        return
    for t in reader if type(reader) is tuple else (reader,):
        if t is not trace and (t.nodes or t.sending):
            flush(t, wait=False, unless_recording=True)


def readers_sent_into(t: Any, trace: Trace) -> None:
    """``readers_sent`` for a write no captured op records (a replay's): the traces of
    other threads' pending ops taking ``t``, a view of it, or its base go first."""
    cell = t.__dict__.get("_b")
    if cell is None:
        return
    if type(cell.ref) is RemoteTensor:
        readers_sent(cell.ref.reader, trace)
    if cell.storage is not None:
        readers_sent(cell.storage.reader, trace)
    base = t._base
    if base is not None and type(base.__dict__["_b"].ref) is RemoteTensor:
        readers_sent(base.__dict__["_b"].ref.reader, trace)


def shared_storage(x: Any) -> Storage | None:
    """The ``Storage`` ``x`` shares with the views made of it (made now if none is yet);
    None for a tensor with no cell."""
    cell = x.__dict__.get("_b")
    if cell is None:
        return None
    if cell.storage is None:
        # made once, whole, before another thread can see it: two threads making one each
        # at once lost the marks put on the one overwritten (a review, not reproduced)
        with _MAKING:
            if cell.storage is None:
                storage = Storage()
                if type(cell.ref) is RemoteTensor:  # who read it before it had views (an
                    # inference tensor's view has no _base: a write looks at this mark alone)
                    storage.reader = cell.ref.reader
                cell.storage = storage
    return cell.storage


_MAKING = threading.Lock()


# writes recorded or forgotten so far, on any thread: a value the client computed before
# a flush is kept after it only if none came in between (known.carried, a review's race)
WRITES = [0]


INFERENCE_WRITE = (  # eager's words
    "Inplace update to inference tensor outside InferenceMode is not allowed.You can make a "
    "clone to get a normal tensor before doing inplace update.See "
    "https://github.com/pytorch/rfcs/pull/17 for more details."
)


def record_writes(node: Node, func: Any, args: tuple, kwargs: dict) -> None:
    """What captured ``node`` (``func``) writes into, in one walk of its written values:
    ``node.bases``, the values of the bases of the views it writes into, as they are now
    (a later ``.data =`` on a base does not move them: a failed write leaves them stale
    too, Note [failed values], failures.poison_writes); and the handles it writes into,
    their bases' and the ``Storage`` each shares with views name ``node`` as their writer.
    The foreach and fused optimizer families' lists of parameters are not looked at for
    ``_base`` (0.1 µs a read, each element each step): the ``Storage`` marks cover
    them."""
    if not written_args(func):
        return
    WRITES[0] += 1
    name = func._schema.name
    optimizer = name.startswith(("aten::_foreach_", "aten::_fused_"))
    bases: list[Any] = []
    storages: list[Storage] = []
    written = [t for t in written_values(func, args, kwargs) if isinstance(t, torch.Tensor)]
    if name.startswith("aten::_foreach_"):
        # Note [foreach writes count]: eager's foreach kernels count their writes in the
        # version counters themselves (the CPU loop of in-place ops, CUDA's kernels), and
        # autograd's ADInplaceOrView does not for them. Captured as one node, a remote
        # one counted nothing: an ``opt.step()`` between a forward and its ``backward()``
        # (a GAN's classic slip), which eager refuses ("modified by an inplace
        # operation"), gave gradients of the stepped weights without a word (a hunt).
        # The fused family counts nothing in eager, so nor here. An inference tensor has
        # no counter: written outside inference mode, eager refuses it (a review: the
        # foreach op took it), here before the op is recorded, so that nothing is written.
        counted = [t for t in written if not t.is_inference()]
        if len(counted) < len(written) and not torch.is_inference_mode_enabled():
            raise RuntimeError(INFERENCE_WRITE)
        torch.autograd.graph.increment_version(counted)
    for t in written:
        cell = t.__dict__.get("_b")
        if cell is None:
            continue
        if type(cell.ref) is RemoteTensor:
            readers_sent(cell.ref.reader, node.trace)
            cell.ref.writer = node
            cell.ref.known = None  # Note [values the client knows] (known.py)
        if cell.storage is not None:
            readers_sent(cell.storage.reader, node.trace)
            cell.storage.writer = node
            cell.storage.written = True
            storages.append(cell.storage)
        base = None if optimizer else t._base
        if base is not None:
            ref = base.__dict__["_b"].ref
            bases.append(ref)
            if type(ref) is RemoteTensor:
                readers_sent(ref.reader, node.trace)
                ref.writer = node
                ref.known = None
    node.bases = tuple(bases)
    if storages:
        node.storages = tuple(storages)


def written_roots(node: Node) -> list[Any]:
    """The handles and pending values ``node`` writes into, each with every value it is a
    view of, along the view ops that made it from another (``bases`` misses a view's
    base where autograd keeps none: an inference tensor's views)."""
    out: list[Any] = []
    writes = written_args(node.op)
    direct = written_values(node.op, node.args or (), node.kwargs or {}) if writes else []
    for ref in [*direct, *node.bases]:
        while isinstance(ref, (RemoteTensor, Pending)):
            out.append(ref)
            made = ref.node if isinstance(ref, Pending) else None
            if made is None or not (getattr(made.op, "is_view", False) and made.args):
                break
            ref = made.args[0]
    return out


def forget_known(t: Any) -> None:
    """A write into ``t`` that no captured op records (a replay's, a followed step's):
    a value the client kept of it, or of a tensor it is a view of, no longer holds (Note
    [values the client knows], known.py)."""
    WRITES[0] += 1
    cell = t.__dict__.get("_b")
    if cell is None:
        return
    if type(cell.ref) is RemoteTensor:
        cell.ref.known = None
    if cell.storage is not None:
        cell.storage.written = True
    base = t._base
    if base is not None and type(base.__dict__["_b"].ref) is RemoteTensor:
        base.__dict__["_b"].ref.known = None
