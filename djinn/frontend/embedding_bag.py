"""``nn.EmbeddingBag`` with gradients, as ops the appliance runs.

Note [embedding bags]: an embedding bag whose weight (or ``per_sample_weights``) needs a
gradient reaches the client as ``aten::_embedding_bag``, and its backward as
``_embedding_bag_backward`` and ``_embedding_bag_per_sample_weights_backward``. The
appliance runs none of them: the backward kernels index the weight's and the gradient's
rows by ``offset2bag`` and ``maximum_indices`` without a bounds check, and those come from
the client (a hostile one sends its own), and ``_embedding_bag``'s CPU kernel returns
outputs of other shapes than its meta kernel says (an empty ``offset2bag`` in sum mode, a
``maximum_indices`` of one per bag where the meta kernel has none), so a remote tensor's
shape would not be its value's. Capture sends instead:

- forward: the bag itself by ``_embedding_bag_forward_only`` (the same kernel, which the
  appliance runs with its offsets checked), ``offset2bag`` from the offsets as the kernel
  makes it (a one at each bag's start, summed), and ``bag_size`` (the indices that are not
  ``padding_idx``, per bag; zeros in sum mode, as the CPU kernel's);
- backward: each index's gradient row, ``grad[offset2bag[i]]``, scaled as the kernel
  scales it (a per-sample weight, ``1 / count`` with ``scale_grad_by_freq``, ``1 /
  bag_size`` in mean mode: one factor, computed in float64 and rounded once, as the
  kernel's), ``padding_idx``'s rows zero, added into a zero gradient by ``index_add``, in
  index order as the kernel's ``axpy`` per index (Note [embedding backward]); in max mode
  each bag's gradient added at its maximum's row, dimension by dimension, empty bags
  skipped; the per-sample weights' gradient the dot product of each index's gradient row
  with its weight row.

Every index is then checked where the appliance uses it (``index_select``,
``index_add``: Note [index bounds]). Float32 and float64 sum-mode gradients equal CPU
eager's to the bit; where the kernel scales, it multiplies inside a BLAS ``axpy`` and
here the scaled row is rounded first: within a rounding of eager, not equal to it.
``sparse=True`` makes a sparse gradient, which cannot live on the appliance: refused at
the forward, typed.
"""

from __future__ import annotations

from typing import Any

import torch

from djinn.errors import UnsupportedOp

FORWARD = torch.ops.aten._embedding_bag.default
BACKWARD = torch.ops.aten._embedding_bag_backward.default
WEIGHTS_BACKWARD = torch.ops.aten._embedding_bag_per_sample_weights_backward.default
SUM, MEAN, MAX = 0, 1, 2


def forward(
    weight: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    scale_grad_by_freq: bool = False,
    mode: int = SUM,
    sparse: bool = False,
    per_sample_weights: torch.Tensor | None = None,
    include_last_offset: bool = False,
    padding_idx: int = -1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_embedding_bag`` as the forward-only bag and its bookkeeping (Note [embedding
    bags])."""
    if sparse:
        raise UnsupportedOp(
            "nn.EmbeddingBag(sparse=True) makes a sparse gradient, and sparse tensors "
            "cannot live on the appliance; use sparse=False (Note [embedding bags])"
        )
    out, _, _, max_indices = torch.ops.aten._embedding_bag_forward_only(
        weight,
        indices,
        offsets,
        scale_grad_by_freq,
        mode,
        sparse,
        per_sample_weights,
        include_last_offset,
        padding_idx,
    )
    n = indices.numel()
    starts = offsets.new_zeros(n + 1).index_add(0, offsets[1:], torch.ones_like(offsets[1:]))
    offset2bag = starts.cumsum(0, dtype=offsets.dtype)[:n]
    bags = out.shape[0]
    if mode == SUM:
        bag_size = offsets.new_zeros(bags)
    else:
        counted = (indices != padding_idx).to(offsets.dtype)
        bag_size = offsets.new_zeros(bags).index_add(0, offset2bag, counted)
    return out, offset2bag, bag_size, max_indices


def backward(
    grad: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    offset2bag: torch.Tensor,
    bag_size: torch.Tensor,
    maximum_indices: torch.Tensor,
    num_weights: int,
    scale_grad_by_freq: bool,
    mode: int,
    sparse: bool,
    per_sample_weights: torch.Tensor | None,
    padding_idx: int = -1,
) -> torch.Tensor:
    """``_embedding_bag_backward`` (dense) by ``index_add`` (Note [embedding bags])."""
    if sparse:
        raise UnsupportedOp("a sparse embedding-bag gradient cannot live on the appliance")
    dim = grad.shape[-1]
    if mode == MAX:
        empty = (bag_size == 0).unsqueeze(-1)
        rows = maximum_indices.masked_fill(empty, 0)
        flat = rows * dim + torch.arange(dim, dtype=rows.dtype, device=rows.device)
        values = grad.masked_fill(empty, 0)
        out = grad.new_zeros(num_weights * dim).index_add(0, flat.reshape(-1), values.reshape(-1))
        return out.view(num_weights, dim)
    # the kernel's order: the indices sorted (the same sort, so the same permutation),
    # each index's rows added in that order, each scaled by one float64 factor
    ordered, perm = indices.sort()
    source = offset2bag.index_select(0, perm)
    rows = grad.index_select(0, source)
    scale = None
    if per_sample_weights is not None:
        scale = per_sample_weights.index_select(0, perm).to(torch.float64)
    if scale_grad_by_freq:
        # the kernel divides the g-th run of equal indices by the count of the index at
        # sorted position g, not its own (PyTorch's CPU kernel; CUDA's uses its own)
        counts = indices.new_zeros(num_weights).index_add(0, indices, torch.ones_like(indices))
        starts = torch.ones_like(ordered, dtype=torch.bool)
        starts[1:] = ordered[1:] != ordered[:-1]
        run = starts.to(ordered.dtype).cumsum(0) - 1
        freq = counts.index_select(0, ordered.index_select(0, run)).to(torch.float64)
        scale = 1.0 / freq if scale is None else scale / freq
    if mode == MEAN:
        size = bag_size.index_select(0, source).to(torch.float64)
        size = size.masked_fill(size == 0, 1)  # an empty bag: the kernel skips the division
        scale = 1.0 / size if scale is None else scale / size
    if scale is not None:
        rows = rows * scale.to(rows.dtype).unsqueeze(-1)
    rows = rows.masked_fill((ordered == padding_idx).unsqueeze(-1), 0)
    return grad.new_zeros(num_weights, dim).index_add(0, ordered, rows)


def weights_backward(
    grad: torch.Tensor,
    weight: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    offset2bag: torch.Tensor,
    mode: int,
    padding_idx: int = -1,
) -> torch.Tensor:
    """``_embedding_bag_per_sample_weights_backward``: each index's gradient row dotted
    with its weight row, zero at ``padding_idx`` (Note [embedding bags])."""
    if mode != SUM:
        raise UnsupportedOp("per_sample_weights are only supported for mode='sum'")
    dots = (grad.index_select(0, offset2bag) * weight.index_select(0, indices)).sum(-1)
    return dots.masked_fill(indices == padding_idx, 0)


HANDLERS: dict[Any, Any] = {
    FORWARD: forward,
    BACKWARD: backward,
    WEIGHTS_BACKWARD: weights_backward,
}
