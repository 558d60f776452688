"""Slice bounds as the appliance accepts them.

Note [slices to the end]: ``x[1:]`` is ``slice(x, dim, 1, 2**63 - 1)``, PyTorch's "to the
end", and autograd passes the same bounds to ``slice_backward``. The appliance refuses
any integer past 2**62 (Note [op validation]), so every ``x[..., k:]`` on a remote
tensor, and its gradient, was INVALID_ARGUMENT. Capture clamps bounds past the sliced
dimension's size to it, as the kernels themselves do, so the op that travels is the
same slice.
"""

from __future__ import annotations

from typing import Any

import torch

# op -> (position of its start argument; end follows it), the size of the sliced dimension
_SIZE: dict[Any, tuple[int, Any]] = {
    torch.ops.aten.slice.Tensor: (2, lambda a, dim: a[0].shape[dim]),
    torch.ops.aten.slice_scatter.default: (3, lambda a, dim: a[0].shape[dim]),
    torch.ops.aten.slice_backward.default: (3, lambda a, dim: a[1][dim]),
}
OPS = tuple(_SIZE)


def clamped(func: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``func``'s arguments with its start and end within the sliced dimension."""
    first, size_of = _SIZE[func]
    args, kwargs = list(args), dict(kwargs)
    dim = args[first - 1] if len(args) > first - 1 else kwargs.get("dim", 0)
    size = size_of(args, dim)
    for pos, key in ((first, "start"), (first + 1, "end")):
        where, at = (args, pos) if len(args) > pos else (kwargs, key)
        v = where[at] if (where is args or at in where) else None
        if type(v) is int and not -size <= v <= size:
            where[at] = size if v > 0 else -size
    return tuple(args), kwargs
