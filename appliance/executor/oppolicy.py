"""Which aten/prims ops a client may run: the op graph is hostile input.

Being in ``torch.ops.aten`` is not enough: a few aten ops touch the file system
(``from_file``), skip bounds checks (``_reshape_alias``, the ``_unsafe_*`` family,
``_index_put_impl_``) or rebind storage (``set_`` with a Storage). Those are refused by
name, and so is any op taking a string argument other than the known enum-like ones
(a string is how a path gets in). After each op, every tensor it returns must lie
inside its own storage — defence in depth against kernels that do not check.
"""

from __future__ import annotations

from typing import Any

import torch

from djinn.errors import ExecutionError, UnsupportedOp

DENIED = frozenset(
    {
        "from_file",
        "_reshape_alias",
        "_reshape_alias_copy",
        "set_",
        "_index_put_impl_",
        "resize_",
        "resize_as_",
        "resize_as_sparse_",
        "sparse_resize_",
        "sparse_resize_and_clear_",
        "_resize_output_",
        "record_stream",
        "_nested_view_from_buffer",
        "_nested_view_from_buffer_copy",
        "_nested_view_from_jagged",
        "_assert_async",
        "_print",
        "_make_per_channel_quantized_tensor",
        "_make_per_tensor_quantized_tensor",
    }
)
DENIED_PARTS = ("unsafe", "from_file", "_from_pool", "share_memory", "_alloc")
# "unsafe" in these names is about autograd's view tracking, not bounds: they check sizes
ALLOWED = frozenset({"_unsafe_view", "unsafe_split", "unsafe_split_with_sizes", "unsafe_chunk"})
SAFE_STRINGS = frozenset(
    {
        "reduce",
        "rounding_mode",
        "approximate",
        "padding",
        "indexing",
        "equation",
        "mode",
        "side",
        "interpolation",
        "norm",
        "UPLO",
        "uplo",
        "driver",
        "ord",
        "pad_mode",
        "reduction",
        "padding_mode",
        "layout",
    }
)
_checked: dict[Any, None] = {}


def check(op: Any) -> None:
    """Raise UNSUPPORTED_OP unless ``op`` is safe to run for a client."""
    if op in _checked:
        return
    schema = op._schema
    name = schema.name.split("::", 1)[-1]
    if name in DENIED or (name not in ALLOWED and any(part in name for part in DENIED_PARTS)):
        raise UnsupportedOp(f"{schema.name} is not allowed on the appliance")
    for arg in schema.arguments:
        kind = str(arg.type)
        if "Storage" in kind:
            raise UnsupportedOp(f"{schema.name}: storage arguments are not allowed")
        if kind.startswith("str") and arg.name not in SAFE_STRINGS:
            raise UnsupportedOp(f"{schema.name}: string argument {arg.name!r} is not allowed")
    _checked[op] = None


def check_bounds(value: Any, op_name: str) -> None:
    """Every returned tensor must address only its own storage."""
    tensors = value if isinstance(value, (tuple, list)) else (value,)
    for t in tensors:
        if not isinstance(t, torch.Tensor) or not t.numel() or t.layout != torch.strided:
            continue
        last = t.storage_offset() + sum(
            (n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)
        )
        if t.storage_offset() < 0 or (last + 1) * t.element_size() > t.untyped_storage().nbytes():
            raise ExecutionError(f"{op_name} produced a view outside its storage")
