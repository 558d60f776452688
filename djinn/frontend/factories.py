"""The kernels behind the remote device: its PrivateUse1 fallback and CPU -> remote moves,
modules' included (registered by ``extension_points.py``).

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

import dataclasses
import sys
from typing import Any

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false

from djinn.errors import UnsupportedOp

from . import lazy, meta, remote_module, shared_copies, special_ops, ties
from .device import DEVICE_TYPE

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
    if ties.PENDING_HOOKS:
        ties.move_hooks()  # Note [hooks through a swap]: the last parameter's swap is done
    adopted = _model_path(x, dtype, device)
    if adopted is not None:
        # the local meta copy keeps its ties too (Note [tied parameters]): counted apart,
        # a tied GPT-2 had one parameter more, and sum(numel) the head twice (a review)
        at = ties.slot(x)
        tied = ties.converting(at, x, adopted.dtype, adopted.device)
        if tied is not None:
            return tied
        ties.converted(at, x)
        return adopted
    at = ties.slot(x)  # Note [tied parameters]
    tied = ties.converting(at, x, dtype or x.dtype, lazy._remote())
    if tied is not None:
        return tied
    same = dtype in (None, x.dtype) and memory_format in (None, torch.preserve_format)
    if same and at is None:  # Note [copies keep shared storage]: inside torch.load only
        shared = shared_copies.loaded_upload(x, lambda whole: to_copy(whole, device=device))
        if shared is not None:
            return shared
    # as is: the upload copies it anyway (eager semantics: later changes must not leak).
    # Not an expanded or otherwise overlapping tensor: eager's copy of one is dense
    # (empty_like), and a remote allocation with its strides cannot be written into
    # (copy_ refused it: "more than one element ... refers to a single memory location")
    # (contiguous answers it at once: the general check costs 30 µs a call, a third of a
    # small tensor's whole `.to(remote)`)
    same = same and (x.is_contiguous() or is_non_overlapping_and_dense_or_false(x))
    local = (
        x if same else torch.ops.aten._to_copy.default(x, dtype=dtype, memory_format=memory_format)
    )
    # a copy resolves the conjugate and negative bits, as local eager's does
    spec = dataclasses.replace(lazy.spec_of(local), bits=0)
    dst = lazy.LazyTensor(spec, lazy.Uninit(spec))
    out = special_ops.copy_into(dst, local)
    ties.converted(at, x)
    return out


# Note [module to]: `model.to(remote)` of an inference-mode transformers model takes the
# model path (one registration by fingerprint, shared weights, KV caches kept remotely),
# which must see the whole module. PyTorch has no hook that sees a module being moved:
# ``Module.to`` hands each parameter to the dispatcher alone, and replacing ``Module.to``
# (what Djinn once did) changes PyTorch for every program that imports Djinn. So the
# ``_to_copy`` kernel, which only runs for moves *to the remote device*, asks the calling
# thread's stack which module ``Module._apply`` is converting (the outermost one: children
# are converted through their parent's ``_apply``). On the first tensor of a module that
# wants the model path, the whole module is registered (all its tensors are still local
# then: nothing has been converted yet) and its class becomes the remote one; every
# tensor of it then converts to ``meta``, so the local copy holds no weight memory.
# Local moves never reach this kernel, so local PyTorch is untouched.
_TO = torch.nn.Module.to.__code__


def _module_being_moved() -> tuple[torch.nn.Module, torch.dtype | None] | None:
    """The module whose ``Module.to``/``cuda``/``_apply`` converts the tensor this kernel
    was given, with the dtype its ``to`` asked for; None for a lone tensor's move."""
    frame = sys._getframe(2)
    module, dtype = None, None
    while frame is not None:
        if frame.f_code is ties.APPLY:
            module, dtype = frame.f_locals.get("self"), None
        elif frame.f_code is _TO and module is not None and frame.f_locals.get("self") is module:
            dtype = frame.f_locals.get("dtype")
        frame = frame.f_back
    return None if module is None else (module, dtype)


def _model_path(x: torch.Tensor, dtype: torch.dtype | None, device: Any) -> torch.Tensor | None:
    """What a module's tensor becomes when its module takes the model path (Note [module
    to]); None when it keeps the graph path."""
    moving = _module_being_moved()
    if moving is None:
        return None
    module, module_dtype = moving
    if getattr(module, "_djinn", None) is None:
        if not remote_module.wants_model_path(module):
            return None
        index = device.index if isinstance(device, torch.device) else None
        remote_module.adopt(module, torch.device(DEVICE_TYPE, index or 0), module_dtype)
    elif not isinstance(module, remote_module.RemoteModelMixin):
        return None
    return torch.empty(x.shape, dtype=dtype or x.dtype, device="meta")
