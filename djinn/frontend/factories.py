"""Factories on the remote device: the PrivateUse1 fallback and ``torch.tensor``.

With the Python backend registered (Note [python backend] in ``device.py``), any aten op
that reaches the PrivateUse1 dispatch key without a LazyTensor argument lands in
``fallback``: ``torch.randn(..., device="remote_accelerator:0")`` arrives as
``empty.memory_format`` followed by ``normal_`` on the result, ``Tensor.to(remote)`` as
``empty_strided`` followed by ``copy_``. Empty allocations become ``Uninit``
LazyTensors; every other op is captured like any op on LazyTensors.

``torch.tensor(data, device=remote)`` trips an internal assert in that path, so it is
wrapped: the tensor is built on the CPU, then moved.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from .device import is_remote

_EMPTY = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default}
_library: torch.library.Library | None = None
_original_tensor = torch.tensor


def fallback(op: Any, *args: Any, **kwargs: Any) -> Any:
    from . import lazy, meta

    if op in _EMPTY:
        mkw = {k: (meta.META if isinstance(v, torch.device) else v) for k, v in kwargs.items()}
        m = op(*args, **mkw)
        spec = lazy.spec_of(m)
        # an empty(0) is usually the out= target of a factory that resizes it
        return lazy.LazyTensor(spec, lazy.Uninit(spec), dynamic=m.numel() == 0)
    return lazy.dispatch(op, args, kwargs)


@functools.wraps(_original_tensor)
def tensor(data: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
    device = kwargs.get("device")
    if device is not None and is_remote(device):
        kwargs = {**kwargs, "device": "cpu"}
        requires_grad = kwargs.pop("requires_grad", False)
        t = _original_tensor(data, *args, **kwargs).to(device)
        return t.requires_grad_(requires_grad) if requires_grad else t
    return _original_tensor(data, *args, **kwargs)


_original_module_to = torch.nn.Module.to


def module_to(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """`model.to(remote)`: inference-mode transformers models register on the model path
    (one upload, shared weights, KV caches kept remotely); other modules move their
    parameters as LazyTensors (the graph path)."""
    from . import devicemap, remote_module

    device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
    if device is not None and devicemap.active_source() == device.type:
        device = torch.device("remote_accelerator", device.index or 0)
        args, kwargs = (device,), ({"dtype": dtype} if dtype is not None else {})
    if device is not None and is_remote(device) and remote_module.wants_model_path(self):
        if dtype is not None:
            _original_module_to(self, dtype=dtype)
        return remote_module.move(self, device)
    return _original_module_to(self, *args, **kwargs)


def install() -> None:
    global _library
    if _library is None:
        _library = torch.library.Library("_", "IMPL")
        _library.fallback(fallback, "PrivateUse1")
        torch.tensor = tensor
        torch.nn.Module.to = module_to
