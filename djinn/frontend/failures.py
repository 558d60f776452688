"""What a failed op leaves behind (Note [failed values]): its outputs, what depended on
them and what it would have written into hold its error."""

from __future__ import annotations

import threading
from typing import Any

import torch

from djinn.errors import DjinnError, ExecutionError, copy_of
from djinn.runtime.remote import RemoteTensor

from .nodes import Binding, Node, Pending, Uninit


class Failed:
    """The value of an op that failed, or that depended on one (Note [failed values]).

    Note [failed values]: an op that fails leaves its own outputs, and the outputs of
    everything computed from them, holding the error; reading one raises it, naming the
    op. Every other tensor in the thread stays usable: a failure never stays in the trace
    to fail the next flush too, and never surfaces as "released before it was read".
    """

    __slots__ = ("error",)

    def __init__(self, error: DjinnError) -> None:
        self.error = copy_of(error)  # Note [raising a kept error]

    @property
    def failed(self) -> DjinnError:  # read like a RemoteTensor's, in an executed node's results
        return self.error


def failed_error(op_name: str, exc: BaseException) -> DjinnError:
    """``exc`` as the typed error a value computed by ``op_name`` raises when used."""
    if isinstance(exc, DjinnError):
        err = type(exc)(f"{op_name}: {exc.message}" if op_name not in exc.message else exc.message)
        err.code = exc.code
    else:
        err = ExecutionError(f"{op_name} failed: {type(exc).__name__}: {exc}")
    err.__cause__ = copy_of(exc)  # as it is now: a raise that goes on adds nothing to it
    return err


_WRITES: dict[Any, tuple[tuple[int, str], ...]] = {}


def written_args(op: Any) -> tuple[tuple[int, str], ...]:
    """(position, name) of the arguments ``op`` writes into (its schema's ``Tensor(a!)``)."""
    known = _WRITES.get(op)
    if known is None:
        schema = getattr(op, "_schema", None)
        known = _WRITES[op] = tuple(
            (i, a.name)
            for i, a in enumerate(schema.arguments if schema is not None else ())
            if a.alias_info is not None and a.alias_info.is_write
        )
    return known


def written_values(op: Any, args: Any, kwargs: Any) -> list[Any]:
    """The values ``op`` is given for the arguments it writes into, lists flattened."""
    out: list[Any] = []
    for i, name in written_args(op):
        value = args[i] if i < len(args) else kwargs.get(name)
        out.extend(value if isinstance(value, (list, tuple)) else (value,))
    return out


def remote_failed(x: RemoteTensor) -> DjinnError | None:
    """The error a handle's value holds: its own, or that of a failed write into a tensor
    it shares bytes with (Note [a failed write's views])."""
    if x.failed is not None:
        return x.failed
    storage = x.storage
    return storage.failed if storage is not None else None


def holds_failure(x: Any) -> bool:
    """Whether ``x`` (a value's ref, or lists and dicts of them) holds an error: a failed
    node's output, a ``Failed``, or a handle that failed or shares bytes with a failed
    write (Note [a failed write's views])."""
    if isinstance(x, Pending):
        if x.node.failed is not None:
            return True
        results = x.node.results if x.node.executed else None
        return bool(results) and holds_failure(results[x.index])
    if isinstance(x, Failed):
        return True
    if isinstance(x, RemoteTensor):
        return remote_failed(x) is not None
    if isinstance(x, (list, tuple)):
        return any(holds_failure(v) for v in x)
    if isinstance(x, dict):
        return any(holds_failure(v) for v in x.values())
    return False


def depends_on_failure(node: Node) -> bool:
    return holds_failure(node.args) or holds_failure(node.kwargs)


def checked_nodes(check: Node) -> tuple[Node, ...]:
    """The nodes whose outputs ``check`` checks, if it is ``_linalg_check_errors``: the
    second half of a linalg op that raises (``linalg.inv`` is ``linalg_inv_ex`` and this
    check). In eager that op failed as a whole and its result was never made (Note
    [values a failed graph dropped], partial.py). Not other ops that only raise
    (``_assert_async(cond)``): the ``cond`` eager hands back stays readable."""
    if check.op is not CHECK or check.args is None:
        return ()
    return tuple({id(x.node): x.node for x in check.args if isinstance(x, Pending)}.values())


CHECK = torch.ops.aten._linalg_check_errors.default


# Note [a failed value overwritten]: a value that holds an error stays failed for what reads
# it, but an op that writes all of it without reading it (``zero_``, ``fill_``, ``copy_``)
# gives it a value again, as eager's would after a ``try`` caught the failure. Each read
# its target and failed too: a hook that raised in a "skip this batch" check left the
# parameters' ``.grad`` failed, and ``zero_grad(set_to_none=False)`` kept them so, every
# later step raising (a hunt). The target is bound to a new allocation that the op then
# writes. Not a target that shares its bytes with another tensor (a view taken of it, or
# it of another: their ``Storage`` mark): healed apart, each would get bytes of its own,
# and a later write into one would miss the other (a review: a base and its view, healed
# in turn, drifted apart without an error). Those stay failed: read, they raise.
OVERWRITES = {
    torch.ops.aten.zero_.default,
    torch.ops.aten.fill_.Scalar,
    torch.ops.aten.fill_.Tensor,
    torch.ops.aten.copy_.default,
    torch.ops.aten._foreach_zero_.default,
    torch.ops.aten._foreach_copy_.default,
}


def failed_targets(args: tuple) -> list[Any]:
    """The targets of an overwriting op (``OVERWRITES``: ``args[0]``, or its list) that
    hold an error."""
    targets = args[0] if type(args[0]) in (list, tuple) else (args[0],)
    out = []
    for t in targets:
        cell = t.__dict__.get("_b") if isinstance(t, torch.Tensor) else None
        if cell is None or cell.storage is not None:
            continue  # it shares its bytes: healed apart, it and the others would drift
        if holds_failure(cell.ref):
            out.append(t)
    return out


def healed(args: tuple, run: Any) -> Any:
    """``run()``, the capture of an overwriting op, with each failed target bound to a new
    allocation first; if the capture raises (a source that failed too, a shape eager
    refuses), each keeps its failure, never the new allocation's bytes."""
    from .meta import spec_of

    old = [(t, t.__dict__["_b"]) for t in failed_targets(args)]
    for t, _ in old:
        t.__dict__["_b"] = Binding(Uninit(spec_of(t)))
    try:
        return run()
    except BaseException:
        for t, cell in old:
            t.__dict__["_b"] = cell
        raise


def is_dependency_error(exc: DjinnError) -> bool:
    """Whether ``exc`` is the failure of one of a node's inputs (passed on as is)."""
    return getattr(exc, "_djinn_failed_value", False)


def fail(node: Node, error: DjinnError) -> None:
    """Note [failed values]: the node's outputs, and the tensors it would have written
    into, hold ``error`` from now on."""
    error._djinn_failed_value = True  # type: ignore[attr-defined]
    # kept as it is now: the caller may raise ``error`` on (Note [raising a kept error])
    error = copy_of(error)
    poison_writes(node, error)
    node.failed = error
    node.executed = True
    node.results = [None] * node.nout
    node.args = node.kwargs = None
    node.rng = node.draw = None
    node.bases = ()
    failed = Failed(error)
    for holders in node.holders:
        for w in holders:
            cell = w()
            if cell is not None and isinstance(cell.ref, Pending) and cell.ref.node is node:
                cell.ref = failed


# Note [a failed write's views]: a view holds a handle of its own, on the bytes its base
# has (``v = a.t()`` once sent). A write into ``a`` that failed poisoned ``a`` (and ``a``'s
# base), but ``v`` still named its handle: reading it gave the bytes from before the
# write, and every later write into ``a`` was lost in it too (``a`` was failed), with no
# error anywhere (a fuzz of views and writes: ``torch.add(a.t(), 1, out=a)``, whose
# overlap eager refuses at the call, then ``a.data.add_(1)``; ``v`` read the values from
# before both). So the ``Storage`` mark a tensor shares with its views (writes.py) keeps
# the error of a failed write into any of them, and a read of any of them raises it, as
# a read of the tensor written raises it.
def poison_writes(node: Node, error: DjinnError) -> None:
    """An in-place or ``out=`` op that did not run leaves its targets without the value
    the program computed: reading them must raise, never return the stale bytes."""
    if node.args is None:
        return
    for ref in written_values(node.op, node.args, node.kwargs or {}):
        _poison(ref, node, error)
    # a view written into shares its base's bytes: the base (and so every view made of
    # it from now on) no longer holds what the program computed either
    for base in node.bases:
        _poison(base, node, error)
    # and no view made of it before: Note [a failed write's views]
    for storage in node.storages:
        storage.failed = storage.failed or error
    node.storages = ()


def _poison(ref: Any, node: Node, error: DjinnError) -> None:
    # a value keeps the first error it held, as a failed node does: the later one (a
    # graph sent behind the failed one, "not run") only names it
    if isinstance(ref, RemoteTensor):
        ref.failed = ref.failed or error
    elif isinstance(ref, Pending) and ref.node.failed is None and ref.node is not node:
        if ref.node.executed:
            if ref.node.results is None:
                ref.node.results = [None] * ref.node.nout
            done = ref.node.results[ref.index]
            if isinstance(done, Failed):
                pass  # it holds its first error already (a value a failed graph dropped)
            elif done is not None:
                done.failed = done.failed or error
            else:  # not kept, but a node still to run reads it: it must fail, not read
                ref.node.results[ref.index] = Failed(error)  # "released" bytes
        else:
            fail(ref.node, error)


# Note [failures raised on their thread]: a graph sent without waiting lands on whichever
# thread reads or flushes next (Note [asynchronous flushes]), and another thread's read
# or write sends a thread's graph (Note [writes another thread captured], [reads another
# thread captured]). A failure was raised where it landed: a thread that wrote a tensor
# another thread's pending ops read raised that thread's singular `linalg.inv`, and the
# thread that called it read nan without an error (a review). So a graph's failure is
# raised only on the thread whose trace it was (its owner), when it lands it. Landed
# elsewhere, what failed holds the error, and the owner's reads of it raise (Note [failed
# values]); but an op whose only effect is to raise (a check: `_linalg_check_errors`) has
# nothing to read, so its error is kept for the owner's next flush (``keep``), where its
# own landing would have raised it. (Keeping every failure raised it again, long after,
# where the owner had already read it from the values: the next test, in the suite.)
# An autograd engine thread's own trace has no owner: what its backward pass sent is
# raised where it lands (backward() raises it at its end). Another thread's graph landed
# by a backward pass is kept for that thread (a review: main's backward raised thread B's
# singular inv, and B never saw it). A thread that ends without another flush never
# raises a kept error, as a thread that died of it in eager raised it nowhere else.
def raise_on_owner(trace: Any, error: DjinnError, keep: bool) -> None:
    """Raise ``error``, a failure of a graph of ``trace``, here if this thread owns the
    trace (or no thread does); else keep it for the owner's next flush if ``keep``."""
    owner = trace.owner
    if owner is None or owner == threading.get_ident():
        raise copy_of(error)
    if keep:
        trace.failures.append(error)
