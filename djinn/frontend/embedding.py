"""The gradient of ``nn.Embedding``, as ops the appliance runs.

Note [embedding backward]: backward through an embedding reaches the client as
``aten::embedding_dense_backward``, which the appliance refuses (UNSUPPORTED_OP): its CPU
kernel indexes a counts array and the gradient rows by the client's indices without a
bounds check, so a hostile index writes outside the allocation. Capture sends what the
kernel computes instead: zeros, and each gradient row added to its index's row in index
order. ``index_add`` does exactly that, one ``add`` per index in order, with the bounds
checked, so for float32 and float64 the result is the kernel's to the bit at every size
(``index_put`` with ``accumulate`` is not: past 32K elements it adds in parallel, in no
fixed order). For float16 and bfloat16 ``index_add`` adds in float32 and rounds once, as
CUDA's kernel does, where the CPU kernel rounds after every add: a row hit often differs
from CPU eager's by the dtype's rounding, and a row hit very often by more, CPU eager's sum
having stalled (a bfloat16 row hit 4,000 times by 1.0 sums to 256 there, 4,000 here).
Indices equal to ``padding_idx`` add a zero row, which leaves that row zero as the
kernel's skip does. With ``scale_grad_by_freq`` each row is scaled by 1 / its index's
count before it is added; the kernel multiplies inside the add (one rounding fewer), so
that case is within a rounding of eager, not equal to it.

Note [sparse embeddings]: ``nn.Embedding(sparse=True)`` gives a sparse gradient, and sparse
tensors cannot live on the appliance. Found during ``backward()``, the refusal could only
be held in the gradient (Note [errors in backward]), whose wrapper is dense: the first
read raised it, but ``SparseAdam`` asks the layout first and raised its own misleading
"does not support dense gradients". So the forward refuses it, typed, where its gradient
would be made: a weight that requires grad, with grad enabled. Without one (inference, a
frozen table) the forward runs as any embedding.
"""

from __future__ import annotations

import torch

from djinn.errors import UnsupportedOp

OP = torch.ops.aten.embedding_dense_backward.default
FORWARD = torch.ops.aten.embedding.default


def refuse_sparse_gradient(args: tuple, kwargs: dict) -> None:
    """Raise UNSUPPORTED_OP for an ``embedding`` whose gradient would be sparse (Note
    [sparse embeddings])."""
    sparse = args[4] if len(args) > 4 else kwargs.get("sparse", False)
    weight = args[0] if args else kwargs.get("weight")
    if sparse and torch.is_grad_enabled() and getattr(weight, "requires_grad", False):
        raise UnsupportedOp(
            "nn.Embedding(sparse=True) makes a sparse gradient, and sparse tensors cannot "
            "live on the appliance; use sparse=False (and torch.optim.Adam rather than "
            "SparseAdam), or run it under torch.no_grad() (Note [sparse embeddings])"
        )


def dense_backward(
    grad: torch.Tensor,
    indices: torch.Tensor,
    num_weights: int,
    padding_idx: int,
    scale_grad_by_freq: bool,
) -> torch.Tensor:
    """``embedding_dense_backward`` by ``index_add`` (Note [embedding backward])."""
    flat = indices.reshape(-1)
    rows = grad.reshape(flat.numel(), grad.shape[-1])
    rows = rows.masked_fill((flat == padding_idx).unsqueeze(-1), 0)
    if scale_grad_by_freq:
        # counted in the indices' integer type (a float16 count stops at 2048), each row
        # scaled by 1.0 / count in the precision the kernel multiplies in
        counts = flat.new_zeros(num_weights).index_add(0, flat, torch.ones_like(flat))
        wide = torch.float64 if rows.dtype == torch.float64 else torch.float32
        scale = counts.index_select(0, flat).to(torch.float64).reciprocal().to(wide)
        rows = (rows.to(wide) * scale.unsqueeze(-1)).to(rows.dtype)
    return rows.new_zeros(num_weights, grad.shape[-1]).index_add(0, flat, rows)
