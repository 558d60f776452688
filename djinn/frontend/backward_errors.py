"""The outputs of an op that failed inside ``backward()``.

Note [errors in backward]: an exception leaving ``__torch_dispatch__`` on the autograd
engine's thread for this backend aborts the process ("terminate called without an active
exception"). Inside ``backward()`` the op's outputs hold the error instead (Note [failed
values], failures.py): ``backward()`` finishes, and the first read of a gradient raises it
as a Python exception. The outputs are shaped by the op's meta kernel; where that fails
too (no meta kernel; ``affine_grid``'s backward, whose ``copy_`` follows a refused
``unsqueeze_`` with operands of the wrong shape), by the likeliest arguments, so that
nothing can leave ``__torch_dispatch__`` there.

Note [failed gradients of local tensors]: the gradient that leaves the appliance for a
local tensor (``x.to(remote)`` of a CPU leaf: autograd's ``ToCopyBackward0`` copies the
gradient back with ``_to_copy``) cannot be a remote tensor holding the failure: autograd
gets a gradient on the wrong device, and its engine stopped at an internal assert
("opt_ready_stream && opt_parent_stream", engine.cpp). It is a ``FailedHere``: a tensor of
the local device, of the gradient's shape, with no storage, on which every op raises the
failure. Autograd's own use of it on the local side (accumulating it into ``x.grad``)
raises it from ``backward()`` there, on the program's thread, where an exception leaves
as any backward error does; a gradient autograd only stores raises at its first read.
Raised, it is the failure reported on that thread (``trace.reported``): a failed check
kept for the thread's next flush is not raised a second time. Two branches' gradients for
one local tensor are summed by the engine outside any node, where an exception aborted
the process (a review): a sum with a ``FailedHere`` is one, and the accumulation into the
tensor's ``.grad`` raises it.
"""

from __future__ import annotations

from typing import Any

import torch

from . import failures
from . import meta as meta_mod
from .device import DEVICE_TYPE
from .meta import META, TensorSpec
from .trace import reported


def failed_outputs(func: Any, args: tuple, kwargs: dict, exc: Exception, make: Any) -> Any:
    """``func``'s outputs, made with ``make(spec, ref)`` (the LazyTensor class), holding
    ``exc`` as their failure."""
    error = exc if getattr(exc, "_djinn_failed_value", False) else None
    if error is None:
        error = failures.failed_error(f"{func._schema.name}.{func._overloadname}", exc)
        error._djinn_failed_value = True  # type: ignore[attr-defined]
    failed = failures.Failed(error)

    def meta(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return _meta_like(x)
        if isinstance(x, torch.device):
            return META
        if type(x) in (list, tuple):
            return type(x)(meta(v) for v in x)
        return x

    try:
        out = func(*[meta(v) for v in args], **{k: meta(v) for k, v in kwargs.items()})
    except Exception:  # no meta kernel, or one that refuses what the failure left behind
        out = _likely_outputs(func, args, kwargs)
    local = _local_target(func, kwargs)
    if local is not None:  # Note [failed gradients of local tensors]
        return FailedHere.like(out, local, error)

    def wrap(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            spec = TensorSpec(x.dtype, tuple(x.shape), tuple(x.stride()), x.storage_offset(), None)
            return make(spec, failed)
        if type(x) in (list, tuple):
            return type(x)(wrap(v) for v in x)
        return x

    targets = _written_targets(func, args, kwargs, make)
    if targets:
        # Note [failed writes in backward]: an in-place or out= op that failed leaves its
        # target holding the failure, not a new tensor: the program goes on with the
        # target itself (``t.unsqueeze_(-1)``, then ``buf.copy_(t)``), and a failure kept
        # only in the returned wrapper let ``buf``, still ``empty``, reach the gradient
        # as garbage, read without an error (a custom backward; affine_grid's). A target
        # that is a view fails its bases too (``buf[0].copy_(...)``, then ``buf`` is
        # read); a list of targets (``_foreach_add_``) fails each. (Other views of the
        # same base, made before, still read its old values: not covered.)
        for t in targets:
            while isinstance(t, make):
                t._ref = failed
                t = t._base
        if not func._schema.returns:
            return None
        if len(func._schema.returns) == 1 and len(targets) == 1:
            return targets[0]
    return wrap(out)


def _local_target(func: Any, kwargs: dict) -> torch.device | None:
    """The local device a copy out of the appliance (``_to_copy``) goes to, if it is one."""
    if func is not torch.ops.aten._to_copy.default or kwargs.get("device") is None:
        return None
    device = torch.device(kwargs["device"])
    return None if device.type == DEVICE_TYPE else device


_SUM, _SUM_INTO = torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor


class FailedHere(torch.Tensor):
    """A local tensor standing for a gradient whose remote computation failed (Note
    [failed gradients of local tensors]): every op on it raises the failure."""

    _djinn_error: Exception

    @staticmethod
    def like(meta: torch.Tensor, device: torch.device, error: Exception) -> FailedHere:
        t = torch.Tensor._make_wrapper_subclass(
            FailedHere, meta.shape, strides=meta.stride(), dtype=meta.dtype, device=device
        )
        t._djinn_error = error
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        flat = torch.utils._pytree.tree_leaves((args, kwargs or {}))
        failed = next(a for a in flat if isinstance(a, FailedHere))
        if torch._C._current_graph_task_id() != -1 and (
            func is _SUM or (func is _SUM_INTO and isinstance(args[0], FailedHere))
        ):
            # the engine summing two branches' gradients for one local tensor: raising
            # there aborted the process (a review); the sum holds the failure. Not a
            # local gradient summed into (``x.grad += g`` accumulating): that raises, and
            # backward() raises it
            return (
                args[0]
                if func is _SUM_INTO
                else FailedHere.like(failed, failed.device, failed._djinn_error)
            )
        raise reported(failed._djinn_error)

    def __repr__(self) -> str:  # printing x.grad is reading it
        raise reported(self._djinn_error)


def _written_targets(func: Any, args: tuple, kwargs: dict, make: Any) -> list[Any]:
    """The remote tensors ``func`` writes into (in-place ``self``, ``out=``, each tensor of
    a written list)."""
    named = _named(func, args, kwargs)
    targets: list[Any] = []
    for a in func._schema.arguments:
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        value = named.get(a.name)
        values = value if isinstance(value, (list, tuple)) else [value]
        targets += [v for v in values if isinstance(v, make)]
    return targets


def _likely_outputs(func: Any, args: tuple, kwargs: dict) -> Any:
    """Outputs for an op that meta inference cannot shape: a write's target for an
    aliased return; otherwise the first tensor argument that is not a gradient (a backward
    op's result has the shape of its forward's input: ``self``, ``input``, CTC's
    ``log_probs``). Autograd checks the shapes it gets against the forward's, and raises
    if one is off."""
    schema = func._schema
    named = _named(func, args, kwargs)
    by_alias = {
        frozenset(a.alias_info.before_set): named.get(a.name)
        for a in schema.arguments
        if a.alias_info is not None
    }
    tensors = [(n, v) for n, v in named.items() if isinstance(v, torch.Tensor)]
    likely = next((v for n, v in tensors if not n.startswith("grad")), None)
    if likely is None and tensors:
        likely = tensors[0][1]
    outs = []
    for r in schema.returns:
        alias = r.alias_info
        source = by_alias.get(frozenset(alias.before_set)) if alias is not None else likely
        if not isinstance(source, torch.Tensor):
            raise RuntimeError(f"{schema.name}: no output to stand for its failure")
        outs.append(_meta_like(source))
    return outs[0] if len(outs) == 1 else tuple(outs)


def _named(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """``func``'s arguments by their schema names."""
    names = (a.name for a in func._schema.arguments)
    return dict(zip(names, args, strict=False)) | kwargs


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    return meta_mod.meta_tensor(*meta_mod.spec_tuple(t))
