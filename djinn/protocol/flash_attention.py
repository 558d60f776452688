"""Which query, key, value and mask the CPU flash-attention kernel may be given (pure).

Note [fused attention] (``djinn/frontend/attention.py``): the frontend captures
``_scaled_dot_product_flash_attention_for_cpu`` only for arguments this module accepts,
and the appliance refuses any other (``appliance/executor/opchecks.py``): one rule, so a
client and its appliance agree on it. The kernel itself checks none of it. It reads the
key and value at the query's batch and head indices, with the query's head size, and
steps through the last dimension one element at a time. It writes its output,
``empty_like(query)``, as rows of unit stride. With fewer key and value heads than query
heads (grouped-query attention), query head ``h`` reads key head ``h // (heads / key
heads)``: in bounds only where the key's heads divide the query's (3 over 2 ran, reading
past the key). A query whose rows overlap (an expanded
batch, say) gets an output of another layout, with gaps the kernel never writes: they
would hand back whatever the allocator held before.
"""

from __future__ import annotations

import torch

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)  # the CPU kernel's


def refusal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why the kernel may not run on these arguments; None when it may."""
    if not (q.dim() == k.dim() == v.dim() == 4):
        return "query, key and value must be 4-D tensors"
    if not (q.dtype == k.dtype == v.dtype and q.dtype in DTYPES):
        return "query, key and value must share one floating dtype"
    if (
        k.shape != v.shape
        or q.shape[0] != k.shape[0]
        or q.shape[3] != k.shape[3]
        or k.shape[1] == 0
        or q.shape[1] % k.shape[1]
    ):
        return (
            "key and value must have the query's batch and head size, and heads that "
            "divide the query's (grouped-query attention reads one key head per group) "
            f"(query {list(q.shape)}, key {list(k.shape)}, value {list(v.shape)})"
        )
    if 0 in q.shape or 0 in k.shape:
        return "empty query, key or value"
    if any(t.stride(3) != 1 for t in (q, k, v)):
        return "the last dimension must be contiguous"
    # rows of the query no closer than a head size: then empty_like(query) has unit
    # stride last too (checked against torch over 200,000 random layouts)
    head = q.shape[3]
    if any(n > 1 and st < head for n, st in zip(q.shape[:3], q.stride()[:3], strict=True)):
        return "the query's dimensions must not overlap"
    return None


def mask_refusal(
    mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor, dtype: torch.dtype | None = None
) -> str | None:
    """Why the kernel may not take ``mask`` as its additive ``attn_mask``; None when it
    may. The shapes local eager sends it (PyTorch's ``check_attn_mask_shape``; any other
    takes the math path there): 2-D or 4-D, each dimension the query's (batch, heads,
    query rows, key rows) or 1, in the query's dtype, or float32 for a float16 or bfloat16
    query (autocast's usual case). The kernel views and expands it to
    (batch, heads, rows, keys), which checks those sizes again, and then reads each row
    as keys in a row from its start: within the mask's extent, for any strides."""
    if mask.dim() not in (2, 4):
        return "attn_mask must be 2-D or 4-D"
    kind = dtype or mask.dtype  # dtype: what the client makes of a bool mask
    reduced = q.dtype in (torch.bfloat16, torch.float16)
    if kind != q.dtype and not (reduced and kind == torch.float32):
        return "attn_mask must have the query's dtype (or float32, for a reduced one)"
    want = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])[-mask.dim() :]
    if any(n not in (1, w) for n, w in zip(mask.shape, want, strict=True)):
        return f"attn_mask of shape {list(mask.shape)} does not broadcast to {list(want)}"
    return None
