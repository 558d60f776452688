"""Tied parameters kept one object through a module's moves to and from the remote device.

Note [tied parameters]: a parameter that is one object under two names (GPT-2's
``lm_head.weight is transformer.wte.weight``) must stay one object on the remote device:
autograd then sums both uses' gradients into one ``.grad``, and the optimizer steps it
once. ``Module._apply`` keeps the object itself where the converted tensor is shallow-copy
compatible with the old one (CPU -> CUDA: ``param.data = ...``), so on CUDA whatever else
holds it (a second slot, another module moved later) holds the moved parameter. A wrapper
subclass is not compatible, so each slot got a new ``Parameter`` of a conversion of its
own: two uploads, two remote copies, and two parameters that trained apart, silently away
from eager's numbers.

So the move's kernel (``_to_copy``, either way: ``factories.to_copy`` to the remote
device, ``special_ops._to_cpu`` back) looks at the ``_apply`` frame above it. Converting a
module's parameter, it remembers, weakly, which ``Parameter`` that slot received. A later
conversion of the same parameter (a second slot in the same move, a submodule moved
before the whole model, a move tried again after a failure) returns that ``Parameter``'s
value instead of converting again, and the slot gets the ``Parameter`` itself, as long as
the parameter was not written since (its version counter) and the move asks for the same
device and dtype. ``_apply`` stores ``self._parameters[key]`` right after the conversion
returns: recording and re-tying both replace the module's dict by one that sees that one
store and then puts a plain dict back. The gradient of a re-tied parameter is not
converted again. Buffers stay apart, as on CUDA, where each ``fn(buf)`` is a new tensor
too. Not covered (the program ties again itself, as transformers' ``tie_weights`` does):
``to_empty``, whose kernel is an allocation that never sees the old tensor.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

_APPLY = torch.nn.Module._apply.__code__
# a parameter converted in a module's move -> (the Parameter its slot received, weakly;
# what the parameter's writes move, when it was converted: _written)
_moved: WeakIdKeyDictionary = WeakIdKeyDictionary()


class Slot:
    """Where ``_apply`` will store what the kernel returns: a module's parameter ``key``."""

    __slots__ = ("grad_of", "key", "module")

    def __init__(self, module: torch.nn.Module, key: str, grad_of: torch.Tensor | None) -> None:
        self.module, self.key, self.grad_of = module, key, grad_of


class _OneStore(dict):
    """``module._parameters`` until ``_apply`` stores ``key``: that store is recorded for
    ``src`` (or replaced by the parameter ``src`` is tied to), then a plain dict is back."""

    def __init__(self, slot: Slot, src: torch.Tensor, tied: torch.Tensor | None) -> None:
        super().__init__(slot.module._parameters)
        self.slot, self.src, self.tied, self.version = slot, src, tied, _written(src)

    def __setitem__(self, key: str, value: Any) -> None:
        if key != self.slot.key:
            return super().__setitem__(key, value)
        if self.tied is not None:
            value = self.tied
        elif isinstance(value, torch.nn.Parameter) or getattr(value, "_is_param", False):
            _moved[self.src] = (weakref.ref(value), self.version)
        plain = dict(self)
        plain[key] = value
        self.slot.module.__dict__["_parameters"] = plain


def _written(src: torch.Tensor) -> tuple[int, int]:
    """What moves when ``src`` is written: its version counter, and for a CPU tensor its
    bytes' address (``src.data = other`` replaces them without counting a version)."""
    return src._version, src.data_ptr() if src.device.type == "cpu" else 0


def slot(x: torch.Tensor) -> Slot | None:
    """The module slot ``x`` is being converted for, when a module's move converts one of
    its parameters (or a parameter's gradient); None for a lone tensor or a buffer."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code is not _APPLY:
        frame = frame.f_back
    if frame is None:
        return None
    f_locals = frame.f_locals
    if "buf" in f_locals or "key" not in f_locals:  # the buffers' loop, or not started
        return None
    param = f_locals.get("param")
    if param is x:
        return Slot(f_locals["self"], f_locals["key"], None)
    if param is not None and f_locals.get("param_grad") is x:
        return Slot(f_locals["self"], f_locals["key"], param)
    return None


def _tied(src: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """The parameter ``src`` became in an earlier conversion, if it still stands for it."""
    hit = _moved.get(src)
    if hit is None:
        return None
    param = hit[0]()
    if param is None or hit[1] != _written(src):
        return None
    if param.device != device or param.dtype != dtype or param.shape != src.shape:
        return None
    return param


def converting(
    at: Slot | None, x: torch.Tensor, dtype: torch.dtype, device: torch.device
) -> torch.Tensor | None:
    """What the kernel converting ``x`` into ``dtype`` on ``device`` returns instead of
    converting it: the value of the parameter ``x`` is tied to (the slot will hold that
    parameter), or that parameter's gradient; None: convert."""
    if at is None:
        return None
    if at.grad_of is not None:
        param = at.module._parameters.get(at.key)
        tied = _tied(at.grad_of, dtype, device)
        if tied is not None and param is tied and tied.grad is not None:
            return tied.grad  # converted with the slot the parameter first had
        return None
    tied = _tied(x, dtype, device)
    if tied is None:
        return None
    at.module.__dict__["_parameters"] = _OneStore(at, x, tied)
    return tied.detach()


def converted(at: Slot | None, x: torch.Tensor) -> None:
    """``x`` was converted for ``at``: remember which parameter the slot receives."""
    if at is not None and at.grad_of is None:
        at.module.__dict__["_parameters"] = _OneStore(at, x, None)
