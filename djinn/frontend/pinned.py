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

Note [pinned memory beside CUDA]: on a CUDA host, PyTorch's kernels ask "the accelerator"
which pinned allocator to use when no device is named (``pin_memory()``, ``is_pinned()``,
``DataLoader(pin_memory=True)``), and ``at::getAccelerator`` prefers PrivateUse1 whenever
one is registered. So ``import djinn`` alone made every ``pin_memory()`` of a CUDA
program raise (seen on an H200, torch 2.11). There ``beside_cuda`` wraps PyTorch's own
CPU kernels and names CUDA where the program named nothing, which is what they did before
the import; a device named explicitly passes through unchanged.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from typing import Any

import torch

_lock = threading.Lock()
_pinned: dict[int, weakref.ref] = {}  # data_ptr -> the tensor pin_memory() returned
OURS = [False]  # whether the CPU kernels below are registered (no CUDA on this client)


def pin_memory(self: torch.Tensor, device: Any = None) -> torch.Tensor:
    out = torch.empty_strided(self.shape, self.stride(), dtype=self.dtype, device="cpu")
    out.copy_(self)
    with _lock:
        for ptr in [p for p, ref in _pinned.items() if ref() is None]:
            del _pinned[ptr]
        if out.numel():
            _pinned[out.data_ptr()] = weakref.ref(out)
    return out


def remember(out: torch.Tensor) -> torch.Tensor:
    """A CPU tensor a factory made with ``pin_memory=True`` under ``djinn run`` (devicemap.py):
    PyTorch's factories ask the backend's C++ hooks for the pinned allocator, as
    ``pin_memory()`` does, and raised NotImplementedError (a review: safetensors'
    ``load_file(path, device="cuda")`` and peft's adapter loading make such tensors). It
    is an ordinary CPU tensor, pinned as ``pin_memory()``'s are (Note [pinned memory])."""
    if out.device.type == "cpu" and out.numel():
        with _lock:
            _pinned[out.untyped_storage().data_ptr()] = weakref.ref(out)
    return out


def is_pinned(self: torch.Tensor, device: Any = None) -> bool:
    if not self.numel():
        return False
    with _lock:
        ref = _pinned.get(self.untyped_storage().data_ptr())
    return ref is not None and ref() is not None


def beside_cuda() -> dict[str, Any]:
    """Note [pinned memory beside CUDA]: ``_pin_memory`` and ``is_pinned`` CPU kernels
    (registered ``with_keyset``) that call PyTorch's own with CUDA named where the program
    named no device; empty where PyTorch cannot hand out its kernels (before 2.9)."""
    get_kernel = getattr(torch.library, "get_kernel", None)
    if get_kernel is None:
        return {}
    pin_kernel = get_kernel("aten::_pin_memory", "CPU")
    pinned_kernel = get_kernel("aten::is_pinned", "CPU")
    cuda = torch.device("cuda")

    def pin_cuda(keyset: Any, self: torch.Tensor, device: Any = None) -> torch.Tensor:
        return pin_kernel.call_boxed(keyset, self, cuda if device is None else device)

    def is_pinned_cuda(keyset: Any, self: torch.Tensor, device: Any = None) -> bool:
        if device is not None:
            return pinned_kernel.call_boxed(keyset, self, device)
        with warnings.catch_warnings():  # naming the device is deprecated for programs
            warnings.simplefilter("ignore")
            return pinned_kernel.call_boxed(keyset, self, cuda)

    return {"_pin_memory": pin_cuda, "is_pinned": is_pinned_cuda}
