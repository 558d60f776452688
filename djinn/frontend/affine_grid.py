"""``F.affine_grid``'s backward on the remote device, without its in-place ``unsqueeze_``.

Note [affine grid backward]: ``affine_grid_generator_backward`` is composite. Its C++ body
(``AffineGridGenerator.cpp``) builds the base grid with ``linspace(...).unsqueeze_(-1)``,
an in-place change of a tensor's shape, which the remote device refuses (a wrapper's sizes
are fixed). So the remote device runs the same body with ``unsqueeze``, its out-of-place
form: the same ops on the same values, the gradient bit-exact with local eager. It is
registered on the autograd key, above the composite's own body. (Since Note [shapes
changed in place] the remote device runs ``unsqueeze_`` too; this body, tested bit-exact,
stays.)
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def _linspace_from_neg_one(like: Tensor, steps: int, align_corners: bool) -> Tensor:
    if steps <= 1:
        return torch.tensor(0, dtype=like.dtype, device=like.device)
    points = torch.linspace(-1, 1, steps, dtype=like.dtype, device=like.device)
    return points if align_corners else points * (steps - 1) / steps


def _base_grid(like: Tensor, size: list[int], align_corners: bool) -> Tensor:
    """``make_base_grid_4D`` / ``_5D``: [N, (D,) H, W, 3] of (x, y, (z,) 1)."""
    n, spatial = size[0], list(size[2:])
    grid = torch.empty(n, *spatial, len(spatial) + 1, dtype=like.dtype, device=like.device)
    steps = list(reversed(spatial))  # x runs along W, y along H, z along D
    for i, count in enumerate(steps):
        points = _linspace_from_neg_one(like, count, align_corners)
        for _ in range(i):
            points = points.unsqueeze(-1)  # eager: unsqueeze_, refused on the remote device
        grid.select(-1, i).copy_(points)
    grid.select(-1, len(spatial)).fill_(1)
    return grid


def affine_grid_generator_backward(grad: Tensor, size: list[int], align_corners: bool) -> Tensor:
    if len(size) not in (4, 5):
        raise RuntimeError("AffineGridGenerator needs 4d (spatial) or 5d (volumetric) inputs.")
    n, spatial = size[0], list(size[2:])
    points = 1
    for count in spatial:
        points *= count
    want = [n, *spatial, len(spatial)]
    if list(grad.shape) != want:
        raise RuntimeError(f"grad_grid must be {want}, got {list(grad.shape)}")
    base = _base_grid(grad, size, align_corners)
    theta = base.view(n, points, len(spatial) + 1).transpose(1, 2)
    return theta.bmm(grad.reshape(n, points, len(spatial))).transpose(1, 2)


KERNELS = {"affine_grid_generator_backward": affine_grid_generator_backward}
