"""The gradient of ``nn.Embedding``, as ops the appliance runs.

Note [embedding backward]: backward through an embedding reaches the client as
``aten::embedding_dense_backward``, which the appliance refuses (UNSUPPORTED_OP): its CPU
kernel indexes a counts array and the gradient rows by the client's indices without a
bounds check, so a hostile index writes outside the allocation. Capture sends what the
kernel computes instead: zeros, and each gradient row added to its index's row in index
order. ``index_add`` does exactly that, one ``add`` per index in order, with the bounds
checked, so the result is the kernel's to the bit at every size (``index_put`` with
``accumulate`` is not: past 32K elements it adds in parallel, in no fixed order).
Indices equal to ``padding_idx`` add a zero row, which leaves that row zero as the
kernel's skip does. With ``scale_grad_by_freq`` each row is divided by its index's count
before it is added; the kernel multiplies inside the add (one rounding fewer), so that case
is within a rounding of eager, not equal to it.
"""

from __future__ import annotations

import torch

OP = torch.ops.aten.embedding_dense_backward.default


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
        counts = rows.new_zeros(num_weights).index_add(0, flat, rows.new_ones(flat.numel()))
        rows = rows * counts.reciprocal().index_select(0, flat).unsqueeze(-1)
    return rows.new_zeros(num_weights, grad.shape[-1]).index_add(0, flat, rows)
