"""The kernels behind the remote device: its PrivateUse1 fallback, CPU -> remote moves,
and ``Module.to`` (registered by ``extension_points.py``).

With the Python backend registered (Note [python backend]), any aten op
that reaches the PrivateUse1 dispatch key without a LazyTensor argument lands in
``fallback``: ``torch.randn(..., device="remote_accelerator:0")`` arrives as
``empty.memory_format`` followed by ``normal_`` on the result. Empty allocations become
``Uninit``
LazyTensors; every other op is captured like any op on LazyTensors.

Note [to_copy kernel]: ``torch.tensor(data, device=remote)`` builds the tensor on the CPU
and moves it with the Python dispatch key excluded; through the fallback that move trips
an internal assert in PyTorch. A kernel registered for ``aten::_to_copy`` on PrivateUse1
takes every CPU -> remote move instead (``torch.tensor``, ``Tensor.to``, ``Module.to``),
so no torch function needs replacing: importing Djinn leaves local PyTorch untouched.
"""

from __future__ import annotations

from typing import Any

import torch

from djinn.errors import UnsupportedOp

from . import lazy, meta, remote_module
from .device import DEVICE_TYPE, is_remote, mapped_source

_EMPTY = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default}


def fallback(op: Any, *args: Any, **kwargs: Any) -> Any:
    if op in _EMPTY:
        mkw = {k: (meta.META if isinstance(v, torch.device) else v) for k, v in kwargs.items()}
        m = op(*args, **mkw)
        spec = lazy.spec_of(m)
        # an empty(0) is usually the out= target of a factory that resizes it
        return lazy.LazyTensor(spec, lazy.Uninit(spec), dynamic=m.numel() == 0)
    return lazy.dispatch(op, args, kwargs)


def to_copy(
    x: torch.Tensor,
    *,
    dtype: torch.dtype | None = None,
    layout: Any = None,
    device: Any = None,
    pin_memory: Any = None,
    non_blocking: bool = False,
    memory_format: Any = None,
) -> torch.Tensor:
    """A CPU tensor moved to the remote device (Note [to_copy kernel]): converted locally
    exactly as ``_to_copy`` would, then uploaded once into an allocation that holds it."""
    if layout not in (None, torch.strided):
        raise UnsupportedOp(f"{layout} tensors cannot be sent to the appliance yet")
    same = dtype in (None, x.dtype) and memory_format in (None, torch.preserve_format)
    # as is: the upload copies it anyway (eager semantics: later changes must not leak)
    local = (
        x if same else torch.ops.aten._to_copy.default(x, dtype=dtype, memory_format=memory_format)
    )
    spec = lazy.spec_of(local)
    dst = lazy.LazyTensor(spec, lazy.Uninit(spec))
    return lazy.copy_into(dst, local)


_original_module_to = torch.nn.Module.to


def module_to(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """`model.to(remote)`: inference-mode transformers models register on the model path
    (one upload, shared weights, KV caches kept remotely); other modules move their
    parameters as LazyTensors (the graph path).

    Note [module to]: the one PyTorch method Djinn still replaces. PyTorch offers no hook
    that sees a whole module being moved (each parameter reaches the dispatcher alone), and
    the model path must see the module. Any move that is not to the remote device goes to
    PyTorch's own ``Module.to`` unchanged (tests/unit/test_import_side_effects.py)."""
    device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
    if device is not None and mapped_source() == device.type:
        device = torch.device(DEVICE_TYPE, device.index or 0)
        args, kwargs = (device,), ({"dtype": dtype} if dtype is not None else {})
    if device is not None and is_remote(device) and remote_module.wants_model_path(self):
        if dtype is not None:
            _original_module_to(self, dtype=dtype)
        return remote_module.move(self, device)
    return _original_module_to(self, *args, **kwargs)
