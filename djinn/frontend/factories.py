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
        return lazy.LazyTensor(spec, lazy.Uninit(spec))
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


_original_arange = torch.arange


@functools.wraps(_original_arange)
def arange(*args: Any, **kwargs: Any) -> torch.Tensor:
    device = kwargs.get("device")
    if device is None or not is_remote(device) or "out" in kwargs:
        return _original_arange(*args, **kwargs)
    # PyTorch sizes arange's output inside the out= kernel and then returns its own
    # empty(0) tensor, which a wrapper subclass cannot resize: capture the functional op.
    from . import lazy

    requires_grad = kwargs.pop("requires_grad", False)
    dtype = _original_arange(*args, **{**kwargs, "device": "meta"}).dtype
    bounds = [a.item() if isinstance(a, torch.Tensor) else a for a in args]
    start, end, step = (0, bounds[0], 1) if len(bounds) == 1 else (*bounds, 1)[:3]
    start = kwargs.get("start", start)
    end = kwargs.get("end", end)
    step = kwargs.get("step", step)
    out = lazy.capture(torch.ops.aten.arange.start_step, (start, end, step),
                       {"dtype": dtype, "device": torch.device(device)})
    return out.requires_grad_(requires_grad) if requires_grad else out


def install() -> None:
    global _library
    if _library is None:
        _library = torch.library.Library("_", "IMPL")  # noqa: TOR901 - fallback registration
        _library.fallback(fallback, "PrivateUse1")
        torch.tensor = tensor
        torch.arange = arange
