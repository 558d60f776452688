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

- what PyTorch knows without the values (shape, dtype, version, flags, ``requires_grad_``,
  hooks) is answered by the meta tensor, and ``device`` by the remote device (eager's
  ``next(model.parameters()).device`` is the GPU), so the model path's own checks and
  analysis never take the weights (they run with subclass handling off: no Python on
  their path);
- ``detach()`` and ``.data``, which ``state_dict()`` uses, give an *alias*: a meta tensor
  that knows whose weight it aliases, and costs nothing until it is used;
- a use of the values, of the weight or of an alias, runs on a copy of the registered
  weight the session gets for it (CALL ``$weights`` with its names), and the model stays
  on the model path: ``p.norm().item()``, ``print(p)``, ``torch.save(state_dict)`` (each
  copy freed with the use). The use is eager's as long as the copy is eager's weight:
  - a use that writes the copy (its version moved), or hands it back (itself, or a view
    the program may write later), makes that copy the weight: the model leaves the model
    path as ``.train()`` takes it (Note [a registered model trains]: its weights copied
    into the session, each parameter keeping its object), with this copy for that weight.
    A write lands in the session's copy, never the shared one;
  - a differentiable use with gradients on, of a weight that requires them, leaves
    first: eager's result would take gradients back to the parameter itself (reads under
    ``torch.no_grad()`` keep the model path), and so do ``data_ptr()`` and storages,
    which tell weights' memory apart (``save_pretrained``);
  - once the model left, a weight is the model's own tensor, and an alias stands for the
    tensor its name gave then (as eager's, it follows later training, and outlives the
    model); a warning says once that the model left.
  The leaving copies are made outside any ``inference_mode`` the program is in: an
  inference tensor could not train, nor be written outside one.

A deep copy of a registered model (``AveragedModel``) is registered too, with weights of
its own class (``own``); a deep copy or a pickle of one weight alone is a copy of its
values. A use of a weight the program replaced while the model was registered (the
model's parameter is another object now) holds no value: refused, typed. Not covered: a
submodule taken before the move (its weights get their class at the program's first look
at the model after it), and KV caches kept on the appliance are no use once the model left.
"""

from __future__ import annotations

import contextlib
import copy
import copyreg
import sys
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from djinn.errors import UnsupportedOp

from . import ties
from .device import is_remote
from .shared_copies import address_of
from .tensor_copy import WEIGHT_SOURCE as SOURCE

_copying = threading.local()  # a registered model's deep copy is under way on this thread
_LOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # a model's: one use at a time
_LOCKS_LOCK = threading.Lock()
# set by remote_module (``connect``): leave(module, given) takes a model off the model path,
# ``given`` the copies it keeps for some weights; fetch(module, names) copies those weights
# into the session, by name
_PATH: dict[str, Callable[..., Any]] = {}


def connect(leave: Callable[..., None], fetch: Callable[..., dict]) -> None:
    _PATH.update(leave=leave, fetch=fetch)


class _Source(NamedTuple):
    owner: torch.nn.Module  # the registered model (held: an alias outlives it, as eager's)
    kind: str  # "parameter" or "buffer"
    name: str  # its first name in the model
    alias: bool  # a detach() of the weight, not the weight itself
    device: torch.device  # the remote device, where the program's weights are
    target: Any = None  # a buffer's tensor, once the model left the model path
    weight: Any = None  # an alias's: the registered weight it aliases


# What PyTorch answers without the values: property getters by name, and calls
_GETTERS_OF_VALUES = frozenset({"T", "mT", "H", "mH", "real", "imag"})  # views: values
_SETTERS = frozenset({"requires_grad", "_backward_hooks", "_post_accumulate_grad_hooks"})
_CALLS = frozenset(
    {
        "size", "dim", "stride", "numel", "nelement", "is_contiguous", "is_floating_point",
        "is_complex", "is_signed", "element_size", "is_inference", "storage_offset",
        "requires_grad_", "get_device", "_is_view", "_use_count", "is_shared", "is_pinned",
        "__len__", "register_hook", "register_post_accumulate_grad_hook", "__setstate__",
        "dim_order", "has_names", "retain_grad", "__hash__",
    }
)  # fmt: skip
_ALIASES = frozenset({("call", "detach"), ("get", "data")})
# Uses that need the weight itself, the model leaving first: what rebinds a tensor to other
# memory (``.data =``, ``set_``; a copy's version would not say it was written), and what
# tells tensors' memory apart (save_pretrained: a meta tensor's address is 0 for all, so
# every weight seemed to share one)
_REBINDS = frozenset(
    {"data_ptr", "untyped_storage", "_typed_storage", "storage", "set_", "resize_", "resize_as_"}
)
# uses whose eager result never has a gradient function: a copy of the values serves them
# with gradients on too; and those whose result is no tensor the program can write
_NOT_HANDED_BACK = frozenset({"__reduce_ex__", "__deepcopy__", "__repr__", "__format__"})
_NOT_DIFFERENTIABLE = _NOT_HANDED_BACK | frozenset(
    {
        "item", "tolist", "numpy", "__array__", "__bool__", "__int__", "__float__",
        "__index__", "eq", "ne", "__eq__", "__ne__", "equal", "allclose", "isclose", "isnan",
        "isinf", "isfinite", "any", "all", "argmax", "argmin", "nonzero", "count_nonzero",
    }
)  # fmt: skip
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
    if what == ("call", "share_memory_"):
        return args[0]  # on the appliance: a no-op, as for a CUDA tensor
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
            weight = source.weight if source.alias else args[0]
            out.__dict__[SOURCE] = source._replace(alias=True, weight=weight)
        return out
    return _use(func, what, args, kwargs)


def _use(func: Any, what: tuple[str, str], args: tuple, kwargs: dict) -> Any:
    """``func`` run on the values of the registered weights it was given: copies of them
    while their model is on the model path, its own weights once it left. One use of a
    model's weights at a time (a review: two threads writing weights of one model each
    wrote a copy, and the first to leave the model path took its copy alone: the other
    write was lost)."""
    flat, spec = tree_flatten((args, kwargs))
    weights = [(i, x) for i, x in enumerate(flat) if isinstance(x, _REGISTERED)]
    sources = [s for s in map(_source, (x for _, x in weights)) if s is not None]
    owners = sorted({id(s.owner): s.owner for s in sources}.items())  # checked when held
    with contextlib.ExitStack() as held:
        for _, owner in owners:
            held.enter_context(lock_of(owner))
        return _use_held(func, what, flat, spec, weights)


def _use_held(func: Any, what: tuple[str, str], flat: list, spec: Any, weights: list) -> Any:
    # eager's result of a differentiable use may take gradients back to the parameters
    # themselves: the model leaves for them
    leaving = (
        what[0] == "set"
        or what[1] in _REBINDS
        or (
            torch.is_grad_enabled()
            and what[1] not in _NOT_DIFFERENTIABLE
            and any(x.requires_grad for _, x in weights)
        )
    )
    wanted: dict[torch.nn.Module, dict[str, None]] = {}
    copied: list[tuple[int, _Source, torch.Tensor]] = []
    for i, x in weights:
        if not isinstance(x, _REGISTERED):
            continue  # the model left while this use waited: ``x`` is its weight now
        source = _checked(x)
        if leaving or not _registered(source.owner):
            flat[i] = _real(x)
        else:
            wanted.setdefault(source.owner, {})[source.name] = None
            copied.append((i, source, x))
    copies = {}  # (model, name): a copy of the registered weight, this use's own
    for owner, names in wanted.items():
        got = _PATH["fetch"](owner, list(names))
        copies.update({(owner, name): got[name] for name in names})
    stood_for = {}  # id of what the function was given: the program's tensor
    for i, source, x in copied:
        value = copies[source.owner, source.name]
        flat[i] = value.detach() if source.alias else value
        stood_for[id(flat[i])] = flat[i], x
    versions = {key: c._version for key, c in copies.items()}
    args, kwargs = tree_unflatten(flat, spec)
    # the remote class's own method or property, if it has one
    kind, name = what
    if kind == "get":
        out = getattr(args[0], name)
    elif kind == "set":
        out = setattr(args[0], name, args[1])
    elif args and getattr(torch.Tensor, name, None) is func:
        out = getattr(args[0], name)(*args[1:], **kwargs)
    else:
        out = func(*args, **kwargs)
    if copies:  # a pickled or copied value cannot be written later
        _keep_written(copies, versions, None if what[1] in _NOT_HANDED_BACK else out)
    # an in-place method returns its tensor: the program's (``p += 1`` sets it back)
    given = stood_for.get(id(out))
    return given[1] if given is not None and given[0] is out else out


def _keep_written(copies: dict, versions: dict, out: Any) -> None:
    """A copy the use wrote into, or handed back (itself or a view: the program may write
    it later), is that weight's value from now on: its model leaves the model path with
    it, as eager's weight would have been written (a copy only read is dropped)."""
    addresses = {address_of(c): key for key, c in copies.items()}
    kept = {key for key, c in copies.items() if c._version != versions[key]}
    for o in tree_flatten(out)[0]:
        if isinstance(o, torch.Tensor) and is_remote(o.device):
            key = addresses.get(address_of(o))
            if key is not None:
                kept.add(key)
    given: dict[torch.nn.Module, dict[str, torch.Tensor]] = {}
    for owner, name in kept:
        given.setdefault(owner, {})[name] = copies[owner, name]
    for owner, values in given.items():
        _leave(owner, values)


class _SetOwn:
    """``set_`` does not reach ``__torch_function__``: a rebinding use, seen here. A
    parametrization registered on a weight sets it to itself (a no-op): its version moved,
    and taking the weights then refused it as written while meta."""

    def set_(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and args[0] is self and not kwargs:
            return self
        return _use(torch.Tensor.set_, ("call", "set_"), (self, *args), kwargs)


class RegisteredParameter(_SetOwn, torch.nn.Parameter):
    """A registered model's meta parameter (Note [weights of a registered model])."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        return _handle(func, args, kwargs)

    def __deepcopy__(self, memo: dict) -> Any:
        if id(self) in memo:
            return memo[id(self)]
        if not getattr(_copying, "on", False):  # this weight alone: a copy of its values
            dup = torch.nn.Parameter(self._values(), self.requires_grad)
            memo[id(self)] = dup
            return dup
        with meta_answers():
            empty = torch.empty_strided(self.size(), self.stride(), dtype=self.dtype, device="meta")
            dup = RegisteredParameter(empty, self.requires_grad)
        dup.__dict__[SOURCE] = self.__dict__.get(SOURCE)  # ``own`` of the copy names it
        memo[id(self)] = dup
        return dup

    def __reduce_ex__(self, proto: Any) -> Any:  # pickled (torch.save) by its values
        return torch._utils._rebuild_parameter, (self._values(), self.requires_grad, {})

    def _values(self) -> torch.Tensor:
        """A copy of its values, as a remote tensor of the program's."""
        with torch.no_grad():
            return _use(torch.Tensor.clone, ("call", "clone"), (self,), {})


class RegisteredBuffer(_SetOwn, torch.Tensor):
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
_REGISTERED = (RegisteredParameter, RegisteredBuffer)


def meta_answers() -> contextlib.AbstractContextManager:
    """Registered weights act as the meta tensors they are: the model path's own checks,
    its analysis, and taking the weights off it."""
    return torch._C.DisableTorchFunctionSubclass()


def own(module: torch.nn.Module, device: torch.device) -> None:
    """Give each meta parameter and buffer of the registered ``module`` its class and
    name; ``device`` is where the program is told they are."""
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
                    t.__dict__[SOURCE] = _Source(module, kind, name, False, device)


def own_once(module: torch.nn.Module) -> None:
    """``own`` a registered model once the move that registered it has made all its
    weights meta (this runs inside that move too: the module's class changed at its
    first tensor), at the program's first look at its parts."""
    binding = module.__dict__.get("_djinn")
    if binding is None or binding.owned or being_moved(module):
        return
    binding.owned = True
    own(module, binding.device)


def deep_copy(module: torch.nn.Module, memo: dict) -> torch.nn.Module:
    """Another module on the same registered model (its binding's twin), with meta weights
    of its own."""
    own_once(module)
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
    own_once(dup)
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
    warnings.warn(
        f"{type(module).__name__} is registered on the appliance (the model path), and the "
        "program wrote one of its weights, kept a view of one, asked for its memory, or "
        "used one with gradients on: its weights are copied into the session and it runs "
        "on the graph path from now on (Note [weights of a registered model]). Reading "
        "weights under torch.no_grad() keeps the model path",
        stacklevel=ties._callers_level(),
    )


class WeightsOwner:
    """Mixed into a registered model's class (before it, in remote_module's mixin): its
    meta weights get their classes at the program's first look at its parts after the
    move, and it copies and pickles with them."""

    def _own(self) -> None:
        own_once(self)

    def __getattr__(self, name: str) -> Any:  # a submodule, a parameter
        self._own()
        return super().__getattr__(name)

    def named_modules(self, *args: Any, **kwargs: Any) -> Any:  # parameters(), modules()
        self._own()
        return super().named_modules(*args, **kwargs)

    def named_children(self) -> Any:  # children()
        self._own()
        return super().named_children()

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """PyTorch's, of detached meta weights: each an alias of its weight."""
        self._own()
        return super().state_dict(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> Any:  # the same registered model, its own weights
        return deep_copy(self, memo)

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickled (``torch.save(model)``) as its own class with its weights' values (each
        a copy, as a read: it stays registered). Its class is made by Djinn, and pickle
        refused it ("not the same object")."""
        state = {k: v for k, v in self.__dict__.items() if k != "_djinn"}
        return copyreg._reconstructor, (plain_class(type(self)), object, None), state


def plain_class(cls: type) -> type:
    """The class a registered model's class was made from."""
    return next(c for c in cls.__mro__[1:] if not issubclass(c, WeightsOwner))


def registered_name(t: torch.Tensor, name: str) -> str:
    """The name a registered model's weight was registered by (``name`` for another)."""
    source = _source(t)
    return source.name if source is not None and not source.alias else name


def _source(t: Any) -> _Source | None:
    return t.__dict__.get(SOURCE) if isinstance(t, torch.Tensor) else None


def lock_of(module: torch.nn.Module) -> threading.RLock:
    """The lock of the uses of ``module``'s weights, and of its leaving the model path."""
    with _LOCKS_LOCK:
        lock = _LOCKS.get(module)
        if lock is None:
            lock = _LOCKS[module] = threading.RLock()
        return lock


def _registered(module: torch.nn.Module) -> bool:
    return "_djinn" in module.__dict__


def _leave(owner: torch.nn.Module, given: dict[str, torch.Tensor] | None = None) -> None:
    with meta_answers(), torch.inference_mode(False):  # the weights outlive the mode
        _PATH["leave"](owner, given or {})


def _checked(x: torch.Tensor) -> _Source:
    """``x``'s source, refused if ``x`` is no longer a weight of its model while the model
    is on the model path (the program replaced it: it has no value of its own)."""
    source = _source(x)
    if source is None:
        raise UnsupportedOp(
            "a meta tensor of a model registered on the appliance that holds no value "
            "(Note [weights of a registered model])"
        )
    if source.alias or source.target is not None or not _registered(source.owner):
        return source
    if not _in_model(source, x):
        raise UnsupportedOp(
            f"{type(source.owner).__name__}'s {source.kind} {source.name!r} was replaced "
            "since this tensor was it; on the model path it held no value here (a meta "
            "tensor), so it has none to use (Note [weights of a registered model])"
        )
    return source


def _in_model(source: _Source, x: torch.Tensor) -> bool:
    """Whether ``x`` is still one of its model's tensors: under its registered name, or
    another (a submodule wrapped since, as peft's LoRA wraps one, renames it)."""
    owner = source.owner
    with meta_answers():
        prefix, _, leaf = source.name.rpartition(".")
        try:
            holder = owner.get_submodule(prefix)
        except AttributeError:
            holder = None
        slots = "_parameters" if source.kind == "parameter" else "_buffers"
        if holder is not None and getattr(holder, slots).get(leaf) is x:
            return True
        named = owner.named_parameters if source.kind == "parameter" else owner.named_buffers
        return any(t is x for _, t in named(remove_duplicate=False))


def _real(x: torch.Tensor) -> torch.Tensor:
    """The model's weight that ``x`` (a registered weight or an alias of one) stands for,
    the model taken off the model path first (a parameter then is that weight: the
    leaving swapped it; a buffer's slot got another tensor, its ``target``)."""
    source = _checked(x)
    if source.alias:
        weight = source.weight
        return (_real(weight) if isinstance(weight, _REGISTERED) else weight).detach()
    if source.target is None and _registered(source.owner):
        _leave(source.owner)
    if not isinstance(x, _REGISTERED):
        return x  # swapped into the model's own remote tensor
    target = x.__dict__[SOURCE].target
    if target is None:
        raise UnsupportedOp(
            f"{type(source.owner).__name__}'s {source.kind} {source.name!r} (this tensor) "
            "is no longer the model's: it held no value here (a meta tensor) (Note [weights "
            "of a registered model])"
        )
    return target


def replaced(buffer: torch.Tensor, value: torch.Tensor) -> None:
    """A registered buffer's slot got ``value`` as its model left the model path: the
    program's ``buffer`` (held, or aliased) stands for it from now on."""
    source = _source(buffer)
    if isinstance(buffer, _REGISTERED) and source is not None and not source.alias:
        buffer.__dict__[SOURCE] = source._replace(target=value)
