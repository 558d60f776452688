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
    m = meta_mod.meta_tensor(spec.dtype, spec.shape, spec.stride, spec.offset)
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
}


_composites: dict[Any, bool] = {}  # per op: dispatch is a hot path


def composite(func: Any) -> bool:
    """Whether ``func`` has a CompositeImplicitAutograd kernel to decompose it by."""
    known = _composites.get(func)
    if known is None:
        known = _composites[func] = torch._C._dispatch_has_kernel_for_dispatch_key(
            func.name(), "CompositeImplicitAutograd"
        )
    return known
