"""Which aten/prims ops a client may run: the op graph is hostile input.

An allowlist (``allowed_ops``): being in ``torch.ops.aten`` is not enough. ATen holds ops
that touch the file system (``from_file``), skip bounds checks (``_reshape_alias``, the
``_unsafe_*`` family, ``sparse_coo_tensor`` with unchecked indices), rebind storage
(``set_``), or are TorchScript internals whose kernels crash on arguments their own
schema admits (``to.prim_dtype(t, None, True, True)`` is a SIGSEGV). A denylist only
ever names the ones someone already found; the allowlist names the ones the frontend
sends, and every one of them is fuzzed. The old denylist stays as a second check, so
a name added to the allowlist by mistake is still refused. Ops taking a string argument
other than the known enum-like ones are refused too (a string is how a path gets in).
After each op, every tensor it returns must lie inside its own storage: defence in
depth against kernels that do not check.
"""

from __future__ import annotations

from typing import Any

import torch

from djinn.errors import ExecutionError, UnsupportedOp

from .allowed_ops import RECORDED

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
        # counts by the client's indices unchecked (scale_grad_by_freq); the frontend sends
        # what it computes as index_add (Note [embedding backward])
        "embedding_backward",
        "embedding_dense_backward",
    }
)
DENIED_PARTS = ("unsafe", "from_file", "_from_pool", "share_memory", "_alloc")
# "unsafe" in these names is about autograd's view tracking, not bounds: they check sizes
ALLOWED = frozenset({"_unsafe_view", "unsafe_split", "unsafe_split_with_sizes", "unsafe_chunk"})
SAFE_STRINGS = frozenset(
    {
        "reduce",
        "api_name",  # _linalg_check_errors: only names the API in its error message
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
# Families allowed whole, wherever the recorded list names one member: the optimizer
# step ops of torch.optim (foreach and fused implementations) and GradScaler's.
FAMILY_PREFIXES = ("_foreach_", "_fused_adam", "_fused_sgd", "_fused_adagrad", "_amp_")
_checked: dict[Any, None] = {}


# The allowlist works by op (every overload of a recorded op: ``maximum.out`` shares
# ``maximum``'s kernel and checks); overloads of other schemas (TorchScript's generic
# ``add.t``) are still refused by the schema checks, which accept no such types.
_PACKETS = frozenset(name.rsplit(".", 1)[0] for name in RECORDED)


def allowed(op: Any) -> bool:
    """Whether ``op`` (an OpOverload) is on the allowlist."""
    schema = op._schema
    if schema.name in _PACKETS:
        return True
    name = schema.name.split("::", 1)[-1]
    if not schema.name.startswith("aten::"):
        return False
    if name.startswith(FAMILY_PREFIXES):
        return True
    # autograd's kernels for an allowed op: reflection_pad1d -> reflection_pad1d_backward
    for suffix in ("_backward", "_backward_data"):
        if name.endswith(suffix):
            return f"aten::{name[: -len(suffix)]}" in _PACKETS
    # the in-place form of an allowed op (relu -> relu_, scatter_add -> scatter_add_): its
    # kernel, writing into its first argument. Not the ones that change a tensor's sizes
    # or strides in place (transpose_, as_strided_): bounds are checked on outputs, and a
    # handle made to look past its storage would be read later.
    if name.endswith("_") and torch.Tag.inplace_view not in op.tags:
        return f"aten::{name[:-1]}" in _PACKETS
    return False


def check(op: Any) -> None:
    """Raise UNSUPPORTED_OP unless ``op`` is safe to run for a client."""
    if op in _checked:
        return
    schema = op._schema
    name = schema.name.split("::", 1)[-1]
    if not allowed(op):
        overload = f".{schema.overload_name}" if schema.overload_name else ""  # not "resize_as_."
        raise UnsupportedOp(f"{schema.name}{overload}: not an op the appliance runs")
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


def allowed_names() -> list[str]:
    """Every op overload a client may run, as ``ns::op.overload`` (for the op fuzz and
    the docs): the recorded list plus the families ``allowed`` computes."""
    out = []
    for full in torch._C._dispatch_get_all_op_names():
        ns, _, rest = full.partition("::")
        if ns not in ("aten", "prims"):
            continue
        name, _, overload = rest.partition(".")
        op = getattr(getattr(getattr(torch.ops, ns), name, None), overload or "default", None)
        if not isinstance(op, torch._ops.OpOverload):
            continue
        try:
            check(op)
        except UnsupportedOp:
            continue
        out.append(f"{ns}::{name}.{overload or 'default'}")
    return sorted(set(out))
