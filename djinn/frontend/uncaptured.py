"""Ops capture does not record as they come: answered from a LazyTensor's spec, or
decomposed.

Size queries (``sym_size``, ``is_contiguous``...) are answered from the tensor's spec,
with a meta twin for the rest: nothing is captured and nothing runs.

Note [composite ops under inference mode]: an op with a CompositeImplicitAutograd kernel
(``linear``, ``layer_norm``, ``scaled_dot_product_attention``...) is decomposed at the
autograd key and never reaches capture, except under ``torch.inference_mode()``, which
skips the autograd keys: it then arrived whole, and the appliance refused it
(UNSUPPORTED_OP: its allowlist holds what the ops decompose to). Capture decomposes it
instead, as PyTorch's own fake tensors do (attention, one of ``lazy.SPECIAL``, takes the
fused kernel instead: Note [fused attention]).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from . import meta as meta_mod


def size_query(func: Any, args: tuple, kwargs: dict) -> Any:
    spec = args[0]._dyn
    if func is _aten.sym_size.default:
        return spec.shape
    if func is _aten.sym_stride.default:
        return spec.stride
    if func is _aten.sym_numel.default:
        return math.prod(spec.shape)
    if func is _aten.sym_storage_offset.default:
        return spec.offset
    if func is _aten.dim.default:
        return len(spec.shape)
    m = meta_mod.meta_tensor(spec.dtype, spec.shape, spec.stride, spec.offset, spec.bits)
    return func(m, *args[1:], **kwargs)  # is_contiguous and friends: ask a meta twin


_aten = torch.ops.aten
SIZE_QUERIES = {
    _aten.sym_size.default,
    _aten.sym_stride.default,
    _aten.sym_numel.default,
    _aten.sym_storage_offset.default,
    _aten.dim.default,
    _aten.is_contiguous.default,
    _aten.is_contiguous.memory_format,
    _aten.is_strides_like_format.default,
    _aten.is_non_overlapping_and_dense.default,
    # the plain queries, which reach the dispatcher from C++ that asks a tensor with the
    # Python key (legacy vmap's _add_batch_dim: autograd.grad(is_grads_batched=True)),
    # and are no registered op to look up (composite() raised "aten::size does not exist")
    _aten.size.default,
    _aten.stride.default,
    _aten.numel.default,
    _aten.storage_offset.default,
}


_composites: dict[Any, bool] = {}  # per op: dispatch is a hot path


# Note [kernels over formulas]: ``silu_backward`` and ``mish_backward`` are the two aten ops
# with both a CompositeImplicitAutograd formula and CPU/CUDA kernels. Local eager runs the
# kernel; on the remote device, which has no kernel of its own, autograd took the formula,
# which rounds 1-2 ulp away from it (found by a module sweep). Their autograd entry for the
# remote device now sends them below autograd (``BELOW_AUTOGRAD``, registered by
# extension_points), where the capture records them whole and the worker runs the kernel
# local eager runs. Autograd calls them only outside grad mode (a double backward takes
# the ``infinitely_differentiable_*`` formula), so nothing is lost below autograd.
KERNELS_OVER_FORMULAS = ("silu_backward", "mish_backward")


def below_autograd(name: str) -> Any:
    op = getattr(_aten, name).default

    def kernel(*args: Any, **kwargs: Any) -> Any:
        with torch._C._AutoDispatchBelowAutograd():
            return op(*args, **kwargs)

    return kernel


def composite(func: Any) -> bool:
    """Whether ``func`` is decomposed on the client: it has a CompositeImplicitAutograd
    kernel, and no CPU kernel of its own (Note [kernels over formulas])."""
    known = _composites.get(func)
    if known is None:
        name = func.name()
        try:
            known = torch._C._dispatch_has_kernel_for_dispatch_key(
                name, "CompositeImplicitAutograd"
            ) and not torch._C._dispatch_has_kernel_for_dispatch_key(name, "CPU")
        except RuntimeError:  # no op of that name in the dispatcher's table: no kernel
            known = False
        _composites[func] = known
    return known
