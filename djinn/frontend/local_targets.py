"""Ops that write into a local (CPU) tensor with a remote operand."""

from __future__ import annotations

from typing import Any

import torch

from .device import DEVICE_TYPE
from .failures import written_values

# eager's kernels fill from a 0-d value on another device by its item() (Fill.cpp)
_FILLS = {
    torch.ops.aten.fill_.Tensor: (1, torch.ops.aten.fill_.Scalar),
    torch.ops.aten.masked_fill_.Tensor: (2, torch.ops.aten.masked_fill_.Scalar),
    torch.ops.aten.index_fill_.int_Tensor: (3, torch.ops.aten.index_fill_.int_Scalar),
}


REMOTE_CLASSES: tuple[type, ...] = ()  # LazyTensor, set by lazy.py (which imports this)


def _remote(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == DEVICE_TYPE


def run(func: Any, args: tuple, kwargs: dict) -> Any:
    """An op writing into a local tensor with a remote operand (``cpu.add_(remote)``, an
    optimizer state left on the CPU while its parameters moved) raises, in eager's words,
    as on CUDA: captured, it wrote into a remote copy, and the local tensor silently kept
    its old value. (A local target taking a remote value whole, ``copy_``, is a special
    op: the value is fetched.) A fill from a remote 0-d value runs here with its value,
    as CUDA's does (a hunt: refused). None: no local target, for the op to be captured."""
    for target in written_values(func, args, kwargs):
        # a remote target (nearly always) is known by its class: .device costs ~0.8 µs,
        # 300 of them per foreach step (a review)
        if not isinstance(target, REMOTE_CLASSES) and isinstance(target, torch.Tensor):
            at, scalar_op = _FILLS.get(func, (None, None))
            value = args[at] if at is not None and len(args) > at else None
            rest = [a for i, a in enumerate(args) if i != at]
            if _remote(value) and value.dim() == 0 and not any(_remote(a) for a in rest):
                return scalar_op(*args[:at], value.item(), *args[at + 1 :], **kwargs)
            device = next((a.device for a in args if _remote(a)), f"{DEVICE_TYPE}:0")
            raise RuntimeError(
                "Expected all tensors to be on the same device, but found at least two "
                f"devices, {device} and {target.device}!"
            )
    return None
