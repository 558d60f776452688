"""A registered model's weights, read or written by the program: Note [weights of a
registered model].

Note [weights of a registered model]: a model on the model path keeps meta tensors
locally; its weights are the appliance's one shared copy (remote_module.py). A program
that read one (``p.norm().item()``, ``print(p)``, ``state_dict()[k].cpu()``) met torch's
untyped "Cannot copy out of meta tensor"; one that wrote one (an EMA's ``copy_`` into a
deep copy, an edit inside ``inference_mode``, where no version counts it) wrote into a meta
tensor, a no-op, and ``torch.save(model.state_dict())`` saved meta tensors, no weight at
all, with only a warning.

So each meta parameter and buffer of a registered model is given a class of its own
(``RegisteredParameter``, still an ``nn.Parameter``; ``RegisteredBuffer``), with a
``__torch_function__`` that tells a question about the tensor from a use of its values:

- what PyTorch knows without the values (its shape, dtype, device, version, flags,
  ``requires_grad_``, hooks) is answered by the meta tensor, as before, so the model path's
  own checks and analysis never take the weights (they also run with subclass handling
  off: no Python on their path);
- ``detach()`` and ``.data``, which ``state_dict()`` uses, give an *alias*: a meta tensor
  that knows whose weight it aliases, and costs nothing until it is used;
- any other use, of the tensor or of an alias, first takes the model off the model path
  as ``.train()`` does (Note [a registered model trains]: its weights copied into the
  session, each parameter keeping its object), warning once, then runs on the copies. A
  read then gives the registered values, a write lands in the session's copy, never in
  the shared one, and an alias reads and writes the model's weight as eager's does, before
  or after a later ``.train()``. ``torch.save`` of the state dict saves the weights.

A deep copy of a registered model (``AveragedModel``) is registered too, with weights of
its own class (``own``); a deep copy of one weight alone is a copy of its values. Taking
the model off the path is the cost of a use: the session then holds a copy of every
weight, and calls run op by op. A use of a weight the program replaced since (the model's
parameter is another object now) holds no value: refused, typed.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.utils._pytree import tree_map

from djinn.errors import UnsupportedOp

from . import ties

SOURCE = "_djinn_weight"  # the attribute that says whose weight a tensor is (tensor_copy.py)
_copying = threading.local()  # a registered model's deep copy is under way on this thread
_LIBRARIES = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))


class _Source(NamedTuple):
    owner: weakref.ref  # the registered model
    kind: str  # "parameter" or "buffer"
    name: str  # its first name in the model
    alias: bool  # a detach() of the weight, not the weight itself
    leave: Callable[[torch.nn.Module], None]  # takes the model off the model path
    device: torch.device  # the remote device, where the program's weights are


# What PyTorch answers without the values: property getters by name, and calls
_GETTERS_OF_VALUES = frozenset({"T", "mT", "H", "mH", "real", "imag"})  # views: values
_SETTERS = frozenset({"requires_grad", "grad", "_backward_hooks", "_post_accumulate_grad_hooks"})
_CALLS = frozenset(
    {
        "size", "dim", "stride", "numel", "nelement", "is_contiguous", "is_floating_point",
        "is_complex", "is_signed", "element_size", "is_inference", "data_ptr",
        "storage_offset", "requires_grad_", "get_device", "_is_view", "_use_count",
        "is_shared", "is_pinned", "type", "__len__", "untyped_storage", "register_hook",
        "register_post_accumulate_grad_hook", "__setstate__", "dim_order", "has_names",
        "retain_grad", "share_memory_", "_typed_storage", "is_set_to", "__hash__",
    }
)  # fmt: skip
_ALIASES = frozenset({("call", "detach"), ("get", "data")})
_WHERE = {
    ("get", "device"): lambda d: d,
    ("get", "is_meta"): lambda d: False,
    ("call", "get_device"): lambda d: d.index,
}


def _what(func: Any) -> tuple[str, str]:
    """("get" | "set" | "call", name) of a function ``__torch_function__`` was given."""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):
        return ("get" if name == "__get__" else "set"), getattr(func.__self__, "__name__", "")
    return "call", name


def _answered_by_meta(what: tuple[str, str]) -> bool:
    kind, name = what
    if kind == "get":
        return name not in _GETTERS_OF_VALUES and name != "data"
    if kind == "set":
        return name in _SETTERS
    return name in _CALLS


def _handle(func: Any, args: tuple, kwargs: dict | None) -> Any:
    kwargs = kwargs or {}
    what = _what(func)
    if what in _WHERE:  # where the weight is for the program: the remote device
        source = _source(args[0])
        if source is not None:
            return _WHERE[what](source.device)
    if _answered_by_meta(what):
        with meta_answers():
            return func(*args, **kwargs)
    if what in _ALIASES:
        with meta_answers():
            out = func(*args, **kwargs)
        source = _source(args[0])
        if type(out) is torch.Tensor and source is not None:
            out.__class__ = RegisteredBuffer
            out.__dict__[SOURCE] = source._replace(alias=True)
        return out
    args, kwargs = tree_map(_real, (args, kwargs))
    kind, name = what
    if kind == "call" and args and getattr(torch.Tensor, name, None) is func:
        return getattr(args[0], name)(*args[1:], **kwargs)  # the remote class's own, if any
    return func(*args, **kwargs)


class RegisteredParameter(torch.nn.Parameter):
    """A registered model's meta parameter (Note [weights of a registered model])."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        return _handle(func, args, kwargs)

    def __deepcopy__(self, memo: dict) -> Any:
        if id(self) in memo:
            return memo[id(self)]
        if not getattr(_copying, "on", False):  # this weight alone: a copy of its values
            return _real(self).__deepcopy__(memo)
        with meta_answers():
            empty = torch.empty_strided(self.size(), self.stride(), dtype=self.dtype, device="meta")
            dup = RegisteredParameter(empty, self.requires_grad)
        dup.__dict__[SOURCE] = self.__dict__.get(SOURCE)  # ``own`` of the copy names it
        memo[id(self)] = dup
        return dup

    def __reduce_ex__(self, proto: Any) -> Any:  # pickled (torch.save) by its values
        return _real(self).__reduce_ex__(proto)


class RegisteredBuffer(torch.Tensor):
    """A registered model's meta buffer, or an alias of one of its weights."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        if func is torch.Tensor.__deepcopy__ and getattr(_copying, "on", False):
            return _meta_copy(args[0], args[1])
        return _handle(func, args, kwargs)


def _meta_copy(t: torch.Tensor, memo: dict) -> torch.Tensor:
    with meta_answers():
        dup = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="meta")
    dup.__class__ = RegisteredBuffer
    dup.__dict__[SOURCE] = t.__dict__.get(SOURCE)
    memo[id(t)] = dup
    return dup


_CLASSES = {torch.nn.Parameter: RegisteredParameter, torch.Tensor: RegisteredBuffer}


def meta_answers() -> contextlib.AbstractContextManager:
    """Registered weights act as the meta tensors they are: the model path's own checks,
    its analysis, and taking the weights off it."""
    return torch._C.DisableTorchFunctionSubclass()


def own(
    module: torch.nn.Module, leave: Callable[[torch.nn.Module], None], device: torch.device
) -> None:
    """Give each meta parameter and buffer of the registered ``module`` its class and
    name; ``leave(module)`` takes the model off the model path; ``device`` is where the
    program is told they are."""
    ref = weakref.ref(module)
    seen: set[int] = set()
    with meta_answers():
        for kind, named in (
            ("parameter", module.named_parameters(remove_duplicate=False)),
            ("buffer", module.named_buffers(remove_duplicate=False)),
        ):
            for name, t in named:
                if id(t) in seen or not t.is_meta:
                    continue
                seen.add(id(t))
                cls = _CLASSES.get(type(t))
                if cls is not None:
                    t.__class__ = cls
                if isinstance(t, (RegisteredParameter, RegisteredBuffer)):
                    t.__dict__[SOURCE] = _Source(ref, kind, name, False, leave, device)


def own_once(module: torch.nn.Module, leave: Callable[[torch.nn.Module], None]) -> None:
    """``own`` a registered model once the move that registered it has made all its
    weights meta (this runs inside that move too: the module's class changed at its
    first tensor), at the program's first look at its parts."""
    binding = module.__dict__.get("_djinn")
    if binding is None or binding.owned or being_moved(module):
        return
    binding.owned = True
    own(module, leave, binding.device)


def deep_copy(module: torch.nn.Module, memo: dict, leave: Callable) -> torch.nn.Module:
    """Another module on the same registered model (its binding's twin), with meta weights
    of its own."""
    own_once(module, leave)
    cls = type(module)
    dup = cls.__new__(cls)
    memo[id(module)] = dup
    was = getattr(_copying, "on", False)
    _copying.on = True
    try:
        state = copy.deepcopy(module.__dict__, memo)
    finally:
        _copying.on = was
    dup.__setstate__(state)
    own_once(dup, leave)
    return dup


def being_moved(module: torch.nn.Module) -> bool:
    """Whether this thread is inside ``module``'s own ``Module._apply`` (its move)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is ties.APPLY and frame.f_locals.get("self") is module:
            return True
        frame = frame.f_back
    return False


def say_taken(module: torch.nn.Module, binding: Any) -> None:
    """Warn, once per model, that a use of a weight takes the model off the model path,
    at the program's line that led to it (past torch's and Djinn's frames)."""
    if binding.told_weights:
        return
    binding.told_weights = True
    level, frame = 1, sys._getframe(0)  # level 1: this function
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_LIBRARIES):
        frame, level = frame.f_back, level + 1
    warnings.warn(
        f"{type(module).__name__} is registered on the appliance (the model path), and the "
        "program used a weight's values: its weights are copied into the session and it "
        "runs on the graph path from now on (Note [weights of a registered model]). To "
        "keep the model path, read weights before the move",
        stacklevel=level,
    )


def _source(t: Any) -> _Source | None:
    return t.__dict__.get(SOURCE) if isinstance(t, torch.Tensor) else None


def _real(x: Any) -> Any:
    """``x``, or for a registered weight (or an alias of one) the model's weight itself,
    the model taken off the model path first."""
    if not isinstance(x, (RegisteredParameter, RegisteredBuffer)):
        return x
    source = _source(x)
    owner = source.owner() if source is not None else None
    if owner is None:
        raise UnsupportedOp(
            "this meta tensor was a weight of a model registered on the appliance (the "
            "model path) that is gone: it holds no value (Note [weights of a registered "
            "model])"
        )
    get = owner.get_parameter if source.kind == "parameter" else owner.get_buffer
    with meta_answers():
        if not source.alias and get(source.name) is not x:
            raise UnsupportedOp(
                f"{type(owner).__name__}'s {source.kind} {source.name!r} was replaced since "
                "this tensor was it; on the model path it held no value here (a meta "
                "tensor), so it has none to use (Note [weights of a registered model])"
            )
        source.leave(owner)
        now = get(source.name)
        if isinstance(now, (RegisteredParameter, RegisteredBuffer)) or now.is_meta:
            raise UnsupportedOp(
                f"{type(owner).__name__}'s {source.kind} {source.name!r} holds no value "
                "(a meta tensor) (Note [weights of a registered model])"
            )
    return now.detach() if source.alias else now
