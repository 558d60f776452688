"""Running an op on meta tensors before the real kernel: shape checks and output size.

Meta kernels are where PyTorch keeps an op's argument checking (the same ``TORCH_CHECK``s
the real kernel does, often more, since structured kernels share them), and they cost
microseconds whatever the sizes. So each node first runs on *replicas* of its tensor
arguments on the meta device — same sizes, strides, offsets and storage sizes, and two
arguments viewing one storage view one replica storage, so in-place and overlap checks
see what the real kernel would. The result tells, before a byte is allocated:

- whether the arguments are consistent (a meta error is the error the client gets);
- how many bytes of *new* storage the op would create, plus any growth of an input's
  storage (``out=`` resizing), which must fit in what is left of the stack segment. A
  3 GiB op on a 2 GiB budget is refused here instead of after the allocator tried.

Ops with no meta kernel (data-dependent output sizes: ``nonzero``, ``unique``, ``item``)
skip this step and rely on the schema checks alone (``opargs``).

Note [meta signatures]: a meta run costs 0.3 to 2 ms of Python in PyTorch's reference
kernels, more than most real CPU kernels it guards: profiled on a GPT-2 forward on the
graph path, it was two thirds of the worker's time. Its outcome depends only on what the
replicas are built from (each tensor's dtype, sizes, strides, offset, storage size, and
which arguments share a storage) and on the other arguments' values. ``checked_run``
keys a bounded LRU of outcomes by exactly that signature, so a repeated step (the next
forward, the next training step, any session's) reuses the verdict PyTorch gave for the
same arguments. A refusal is not cached: it costs its sender, not the others.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from djinn.errors import ExecutionError

_META = torch.device("meta")


class NoMetaKernel(Exception):
    """The op cannot run on meta tensors; nothing is known about its output."""


def new_bytes(op: Any, args: list[Any], kwargs: dict[str, Any]) -> int:
    """Bytes of storage ``op(*args, **kwargs)`` would allocate, from a meta run.

    Raises EXECUTION_ERROR when the meta kernel rejects the arguments, NoMetaKernel when
    there is none."""
    return meta_run(op, args, kwargs)[0]


def meta_run(op: Any, args: list[Any], kwargs: dict[str, Any]) -> tuple[int, Any]:
    """(bytes ``op`` would allocate, its meta output), as ``new_bytes``."""
    storages: dict[int, torch.UntypedStorage] = {}  # real storage -> its meta replica
    before: dict[int, int] = {}

    def replica(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            real = x.untyped_storage()
            st = storages.get(real._cdata)
            if st is None:
                st = storages[real._cdata] = torch.UntypedStorage(real.nbytes(), device=_META)
            m = torch.empty(0, dtype=x.dtype, device=_META)
            return m.set_(st, x.storage_offset(), x.size(), x.stride())
        if isinstance(x, (list, tuple)):
            return type(x)(replica(v) for v in x)
        if isinstance(x, torch.device):
            return _META
        return x

    margs = [replica(a) for a in args]
    mkwargs = {k: replica(v) for k, v in kwargs.items()}
    for st in storages.values():
        before[st._cdata] = st.nbytes()
    # A factory given no device, or device None, would run on the CPU and allocate for
    # real (an OpOverload ignores ``with torch.device``): name the meta device explicitly.
    # (An explicit None slipped through: randperm(2**31 - 1, dtype=float64, device=None)
    # allocated 16 GiB in the check meant to refuse it, and the host killed the worker.)
    positional = [a.name for a in op._schema.arguments if not a.kwarg_only][: len(margs)]
    if any(a.name == "device" for a in op._schema.arguments):
        if "device" in positional:
            at = positional.index("device")
            if margs[at] is None:
                margs[at] = _META
        elif mkwargs.get("device") is None:
            mkwargs["device"] = _META
    try:
        out = op(*margs, **mkwargs)
    except NotImplementedError:
        raise NoMetaKernel(op) from None
    except ZeroDivisionError:
        # PyTorch's Python meta kernels of these losses' backward divide by the input's
        # numel: an empty batch, which the real kernel takes (a nan loss, an empty
        # gradient of the input's shape), raised here (a hunt). Their outputs have the
        # input's shape: empty, nothing to make room for.
        if op in _EMPTY_LOSS_GRADS and any(t.numel() == 0 for t in tensors_of(args)):
            raise NoMetaKernel(op) from None
        raise ExecutionError(f"{op._schema.name}: division by zero in its meta kernel") from None
    except Exception as exc:  # any refusal of client-chosen arguments (linalg_eig of uint8:
        # KeyError inside PyTorch's meta kernel) is that request's typed error
        text = str(exc)
        if "meta" in text.lower():  # "cannot be called on meta tensors": no meta story
            raise NoMetaKernel(op) from None
        raise ExecutionError(f"{op._schema.name}: {text.splitlines()[0][:500]}") from None
    grown = sum(max(0, st.nbytes() - before[st._cdata]) for st in storages.values())
    seen = set(before)
    total = grown
    for t in tensors_of(out):
        st = t.untyped_storage()
        if st._cdata not in seen:
            seen.add(st._cdata)
            total += st.nbytes()
    return total, out


_EMPTY_LOSS_GRADS = {
    torch.ops.aten.mse_loss_backward.default,
    torch.ops.aten.smooth_l1_loss_backward.default,
    torch.ops.aten.huber_loss_backward.default,
}


def tensors_of(value: Any) -> list[torch.Tensor]:
    """The tensors of an op's output (a tensor, or lists and tuples of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_of(v)]
    return []


# -- Note [meta signatures] ------------------------------------------------------------
CACHE_ENTRIES = 16384  # outcomes kept: meta outputs hold no memory, keys a few hundred bytes
_NO_META = object()
_cache: OrderedDict[tuple, Any] = OrderedDict()
_SCALARS = (bool, int, float, complex, str, torch.dtype, torch.device, torch.layout,
            torch.memory_format)  # fmt: skip


class _Unkeyable(Exception):
    pass


def signature(op: Any, args: list[Any], kwargs: dict[str, Any]) -> tuple:
    """Everything a meta run of ``op`` sees, as a hashable key (Note [meta signatures])."""
    storages: dict[int, int] = {}
    loose = _shape_free(op)

    def sig(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            st = x.untyped_storage()
            shared = storages.setdefault(st._cdata, len(storages))
            return (x.dtype, tuple(x.shape), x.stride(), x.storage_offset(), st.nbytes(), shared)
        if isinstance(x, (list, tuple)):
            return (type(x) is list, tuple(sig(v) for v in x))
        if x is None:
            return None
        if loose and type(x) in (int, float, complex):
            return (type(x),)  # Note [number-free signatures]
        if isinstance(x, _SCALARS):
            return (type(x), x)  # 1, 1.0 and True are different arguments
        raise _Unkeyable

    return (op, tuple(sig(a) for a in args), tuple((k, sig(v)) for k, v in kwargs.items()))


# Note [number-free signatures]: Adam's step sizes and bias corrections are new Python
# floats at every step, so its ``_foreach_*`` ops (a few hundred tensors each) missed
# the cache at every step and re-ran their meta kernels: most of a small model's
# training step on the worker. For pointwise ops (``torch.Tag.pointwise``) and the
# ``_foreach_`` family, a number's value decides neither an output's shape nor its dtype
# (type promotion looks at its kind: bool, int, float, complex), so the key keeps the
# kind only. A value check a meta kernel would have made (an integer tensor to a
# negative power) is made again by the real kernel: the request still gets its
# EXECUTION_ERROR, and nothing is allocated on the strength of a wrong size.
_SHAPE_FREE: dict[Any, bool] = {}


def _shape_free(op: Any) -> bool:
    known = _SHAPE_FREE.get(op)
    if known is None:
        name = op._schema.name
        known = name.startswith("aten::_foreach_") or torch.Tag.pointwise in op.tags
        _SHAPE_FREE[op] = known
    return known


def checked_run(op: Any, args: list[Any], kwargs: dict[str, Any]) -> tuple[int, Any]:
    """``meta_run``, reusing the outcome for a signature seen before."""
    try:
        key = signature(op, args, kwargs)
        hit = _cache.get(key)
    except (_Unkeyable, TypeError):  # an unhashable value: nothing to reuse
        return meta_run(op, args, kwargs)
    if hit is not None:
        _cache.move_to_end(key)
        if hit is _NO_META:
            raise NoMetaKernel(op)
        return hit
    try:
        outcome = meta_run(op, args, kwargs)
    except NoMetaKernel:
        _remember(key, _NO_META)
        raise
    _remember(key, outcome)
    return outcome


def _remember(key: tuple, outcome: Any) -> None:
    _cache[key] = outcome
    if len(_cache) > CACHE_ENTRIES:
        _cache.popitem(last=False)


def cache_size() -> int:
    return len(_cache)
