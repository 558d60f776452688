"""Pinned host memory for the remote device: ``pin_memory()`` and ``DataLoader(pin_memory=
True)`` work, and ``non_blocking=True`` copies stay exact.

Note [pinned memory]: PyTorch pins memory through the backend's C++ hooks
(``getPinnedMemoryAllocator``), which a Python backend cannot provide, so ``pin_memory()``
raises NotImplementedError once the remote device is registered. A page-locked client
buffer would buy nothing here anyway: bytes leave the client through a socket or the
shared-memory arena, and every upload is complete before ``.to()`` returns (so a
``non_blocking`` copy is as safe as a blocking one). The kernels below make a pinned
tensor an ordinary CPU copy and remember it, so ``is_pinned()`` answers truthfully.

``extension_points.py`` registers them only on a client where no other accelerator can
pin memory (no CUDA): there PyTorch's own kernel can only raise, so nothing that worked
changes.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

_lock = threading.Lock()
_pinned: dict[int, weakref.ref] = {}  # data_ptr -> the tensor pin_memory() returned


def pin_memory(self: torch.Tensor, device: Any = None) -> torch.Tensor:
    out = torch.empty_strided(self.shape, self.stride(), dtype=self.dtype)
    out.copy_(self)
    with _lock:
        for ptr in [p for p, ref in _pinned.items() if ref() is None]:
            del _pinned[ptr]
        if out.numel():
            _pinned[out.data_ptr()] = weakref.ref(out)
    return out


def is_pinned(self: torch.Tensor, device: Any = None) -> bool:
    if not self.numel():
        return False
    with _lock:
        ref = _pinned.get(self.untyped_storage().data_ptr())
    return ref is not None and ref() is not None
