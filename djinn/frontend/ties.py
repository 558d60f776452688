"""Tied parameters kept one object through ``Module.to(remote)``.

Note [tied parameters]: a parameter that is one object under two names (GPT-2's
``lm_head.weight is transformer.wte.weight``) must stay one object on the remote device:
autograd then sums both uses' gradients into one ``.grad``, and the optimizer steps it
once. ``Module._apply`` keeps the object only where the converted tensor is shallow-copy
compatible with the old one (CPU -> CUDA: ``param.data = ...``). A wrapper subclass is not,
so each module slot got a new ``Parameter`` of a conversion of its own: two uploads, two
remote copies, and two parameters that trained apart, silently away from eager's numbers.

The ``_to_copy`` kernel sees each conversion with ``_apply``'s frame above it. Within one
move (keyed by the ``fn`` every nested ``_apply`` is handed, which lives as long as the
move), a parameter met a second time is not uploaded again, and its slot gets the
``Parameter`` the first slot got. ``_apply`` stores ``self._parameters[key]`` right after
the conversion returns, so the module's dict is replaced by one whose store of that key
keeps the first parameter and puts a plain dict back. Buffers stay apart, as on CUDA,
where each ``fn(buf)`` is a new tensor too.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch

from . import lazy

_APPLY = torch.nn.Module._apply.__code__
# a move's fn -> {id(source): (source, module, key)}: where each parameter went first
_moves: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _Retie(dict):
    """``module._parameters`` until ``_apply`` stores ``key``: that store keeps ``param``
    (Note [tied parameters]) and gives the module a plain dict again."""

    def __init__(self, module: torch.nn.Module, key: str, param: torch.Tensor) -> None:
        super().__init__(module._parameters)
        self.module, self.key, self.param = module, key, param

    def __setitem__(self, key: str, value: Any) -> None:
        if key != self.key:
            return super().__setitem__(key, value)
        plain = dict(self)
        plain[key] = self.param
        self.module.__dict__["_parameters"] = plain


def _slot(x: torch.Tensor) -> tuple[Any, torch.nn.Module, str] | None:
    """(fn, module, key) of the ``_apply`` converting ``x`` as a module's parameter; None
    for a lone tensor, a buffer or a gradient."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code is not _APPLY:
        frame = frame.f_back
    if frame is None:
        return None
    f_locals = frame.f_locals
    if f_locals.get("param") is not x or "key" not in f_locals or "buf" in f_locals:
        return None
    return f_locals.get("fn"), f_locals["self"], f_locals["key"]


def already_moved(x: torch.Tensor) -> torch.Tensor | None:
    """The remote parameter ``x`` became earlier in this move, as a fresh alias (its slot
    is re-tied to that parameter); None when ``x`` is met for the first time, and from
    then on it is remembered."""
    slot = _slot(x)
    if slot is None:
        return None
    fn, module, key = slot
    try:
        seen = _moves.setdefault(fn, {})
    except TypeError:  # an fn that takes no weak reference: nothing to key the move by
        return None
    first = seen.get(id(x))
    if first is None:
        seen[id(x)] = (x, module, key)
        return None
    _, owner, owner_key = first
    param = owner._parameters.get(owner_key)
    if not isinstance(param, lazy.LazyTensor):
        return None
    module.__dict__["_parameters"] = _Retie(module, key, param)
    return param.detach()
