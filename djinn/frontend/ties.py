"""Parameters that keep their identity, and their ties, through a module's moves to and
from the remote device.

Note [parameters keep their identity]: on CUDA, ``model.to("cuda")`` keeps every
``Parameter`` object and changes what it holds (``Module._apply``: ``param.data =
converted``, since a CPU and a CUDA tensor are shallow-copy compatible). Whatever holds a
parameter sees it moved: an optimizer built before the move, a second module slot tying
it. A remote tensor is a wrapper subclass, not compatible, so ``_apply`` gave each slot a
new ``Parameter``: an optimizer built first kept stepping the CPU tensors, and training
changed nothing, silently. ``_apply`` keeps the object where the converted tensor is a
*traceable* wrapper subclass: it swaps the two tensors' contents
(``torch.utils.swap_tensors``). So ``LazyTensor`` shows the traceable-subclass protocol,
but only to that check in ``_apply`` (``SeenByApply``): torch.compile's dynamo asks the
same question, and must keep running a remote model as it always has. A swap needs the
old tensor to be held by nothing else (no weak reference, no second C++ reference: a CPU
autograd graph still alive that saved the weight, as a convolution's does); where it
cannot, the protocol is not shown, and ``_apply`` falls back to a new ``Parameter``, whose
ties are kept as below. Moves between remote dtypes (``model.half()``) set ``.data``
(Note [set data], lazy.py), which keeps the object too. Moves back to the CPU: ``_apply``
swaps only into a wrapper subclass, and made new ``Parameter`` objects, so the loop
"``model.cpu()``, save a checkpoint, ``model.to(remote)``, train on" trained nothing after
the round trip, silently (a review): its optimizer held the remote parameters the move
back had replaced. The kernel moving a parameter back (``special_ops._to_cpu``) therefore
swaps the new ``Parameter`` into the old object as ``_apply`` stores it (``_SwapStore``),
where ``swap_tensors`` accepts the old one; its gradient is moved apart, first. Where it
cannot be swapped, a new ``Parameter`` as before, and a warning says so.

Note [tied parameters]: a parameter that is one object under two names (GPT-2's
``lm_head.weight is transformer.wte.weight``) must stay one object on the other device:
autograd then sums both uses' gradients into one ``.grad``, and the optimizer steps it
once. A swapped parameter keeps its ties by itself: the second slot holds the same object,
already moved. Where a move makes new ``Parameter`` objects (back to the CPU, or the
fallback above), each slot got a new one of a conversion of its own: two copies, and two
parameters that trained apart, silently away from eager's numbers.

So the move's kernel (``_to_copy``, either way: ``factories.to_copy`` to the remote
device, ``special_ops._to_cpu`` back) looks at the ``_apply`` frame above it. Converting a
module's parameter, it remembers which ``Parameter`` that slot received. A later
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

import copyreg
import os
import sys
import threading
import warnings
import weakref
from typing import Any

import torch
import torch.utils._python_dispatch as _python_dispatch
from torch.utils.weak import WeakIdKeyDictionary

from .device import DEVICE_TYPE
from .model_changes import version_of

APPLY = torch.nn.Module._apply.__code__  # the frame of a module's move (factories uses it too)
_PROTOCOL_CHECKS = _python_dispatch.__file__  # is_traceable_wrapper_subclass and its helper
_LIBRARIES = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))
_MOVES = {"to", "cuda", "cpu", "half", "float", "double", "bfloat16", "type", "_apply"}
# a parameter converted in a module's move, weakly -> (the Parameter its slot received;
# what the parameter's writes move, when it was converted: _written). A remote Parameter
# is held weakly. A local one (a move back to the CPU) strongly: a weak reference to it
# would keep a later move from swapping it. Its entry goes when that swap makes it
# remote (_forget), else it would keep a remote copy alive for as long as the old
# parameter lives (an optimizer holds it), one more with every round trip.
_moved: WeakIdKeyDictionary = WeakIdKeyDictionary()
_recorded_for: dict[int, weakref.ref] = {}  # id of a local Parameter in _moved -> its key


class SeenByApply:
    """An attribute of the traceable-subclass protocol (``__tensor_flatten__``,
    ``__tensor_unflatten__``) that exists only for ``Module._apply``'s check, and there
    only when the parameter being moved can be swapped (Note [parameters keep their
    identity]). ``_apply`` never calls it: it only asks whether it is there."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        frame = sys._getframe(1)
        for _ in range(4):  # hasattr <- the protocol's helpers <- Module._apply
            if frame is None:
                break
            if frame.f_code is APPLY:
                f_locals = frame.f_locals
                param = f_locals.get("param")
                if swaps(param):
                    _forget(param)
                    _hooks_to_move(param)
                    # the kernel set up a new Parameter's ties: the swap keeps them itself
                    params = f_locals["self"]._parameters
                    if isinstance(params, _StoreOnce):
                        params.cancel()
                    return _not_flattened
                if _is_local(param) and not _recorded(param):  # not a tie kept below
                    _warn_new_parameter(f_locals["self"], f_locals.get("key"))
                break
            if frame.f_code.co_filename != _PROTOCOL_CHECKS:
                break
            frame = frame.f_back
        raise AttributeError(self.name)


# Note [hooks through a swap]: a gradient hook (``p.register_hook``) and a post-accumulate
# hook live in C++ on the tensor the parameter holds, pointing at the dict the parameter
# keeps (``_backward_hooks``). ``_apply``'s ``swap_tensors`` gives the parameter the moved
# tensor and keeps the dict, but the C++ hooks stayed with the CPU tensor, which the
# parameter no longer is: a hook registered before ``model.to(remote)`` never ran (a
# hunt: a ``g * 10`` hook left the gradient undoubled, a gradient-zeroing one left it as
# it was, without a word). Setting the dict again registers it on the tensor held now,
# as the move back does (``give_state``). The swap comes after the last Djinn code that
# ``_apply`` runs for that parameter, so the parameter waits here until Djinn's next
# captured op or conversion (a forward's ops come before any backward). One whose swap
# raised (``_apply`` says it "Couldn't swap") stays local, and waits on.
PENDING_HOOKS: list[tuple[torch.Tensor, Any, Any]] = []
_MOVING_HOOKS = threading.Lock()


def _hooks_to_move(param: torch.Tensor) -> None:
    hooks, post = param._backward_hooks, getattr(param, "_post_accumulate_grad_hooks", None)
    if not hooks and not post:
        return
    with _MOVING_HOOKS:  # asked twice per swap (both protocol attributes): kept once
        if not any(p is param for p, _, _ in PENDING_HOOKS):
            # a strong reference (swap_tensors refuses a weakly referenced tensor), held
            # until Djinn's next op or conversion
            PENDING_HOOKS.append((param, hooks, post))


def move_hooks() -> None:
    """Register again the hooks of the parameters swapped since (Note [hooks through a
    swap]), on the tensors they hold now; one not swapped yet (the move's own ops run
    before its swap) waits on."""
    with _MOVING_HOOKS:
        waiting = []
        for entry in PENDING_HOOKS:
            param, hooks, post = entry
            if _is_local(param):
                waiting.append(entry)
            else:
                give_state(param, ({}, hooks, post))
        PENDING_HOOKS[:] = waiting


def _not_flattened(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("a remote tensor has no inner tensors to flatten")


def swaps(param: Any) -> bool:
    """Whether ``Module._apply`` moving ``param`` onto the remote device swaps it into the
    converted tensor, keeping the object: a local parameter that ``swap_tensors`` accepts
    (the same checks, made first), gradient included."""
    if not _is_local(param) or copyreg._slotnames(type(param)):  # type: ignore[attr-defined]
        return False  # swap_tensors swaps only between classes with the same slots
    grad = param.grad
    # the parameter holds its gradient (a second use), and lets go of it before the swap
    return swappable(param) and (grad is None or swappable(grad, uses_by_others=1))


def _is_local(param: Any) -> bool:
    return isinstance(param, torch.Tensor) and param.device.type != DEVICE_TYPE


def _warn_new_parameter(module: torch.nn.Module, key: str | None, back: bool = False) -> None:
    where, which = ("back from", "remote") if back else ("to", "local")
    warnings.warn(
        f"djinn: {type(module).__name__}.{key} moves {where} the remote device as a new "
        f"Parameter object, not in place: something else still holds the {which} one (a "
        "weak reference, or an autograd graph that saved it), or its class has __slots__. "
        f"An optimizer built before this move keeps the {which} parameter and will not "
        "train the moved one: build it after the move, or free what holds the parameter "
        "first (Note [parameters keep their identity]).",
        RuntimeWarning,
        stacklevel=_callers_level(),
    )


def _callers_level() -> int:
    """The ``stacklevel`` that names the program's line (``model.to(...)``), however deep
    the module tree made ``_apply``'s recursion."""
    level, frame = 2, sys._getframe(2)  # level 1: the function that warns
    while frame is not None and (
        frame.f_code.co_filename.startswith(_LIBRARIES)
        or (  # a library's own override of a move (transformers' PreTrainedModel.to)
            frame.f_code.co_name in _MOVES
            and isinstance(frame.f_locals.get("self"), torch.nn.Module)
        )
    ):
        frame, level = frame.f_back, level + 1
    return level


def swappable(t: torch.Tensor, uses_by_others: int = 0) -> bool:
    if weakref.getweakrefs(t):
        return False
    uses = t._use_count() - uses_by_others
    if uses <= 1:
        return True
    if uses != 2 or not t.is_leaf or not t.requires_grad:
        return False
    # the second use may be the parameter's gradient accumulator, which swap_tensors
    # accepts; asking for it creates it if there was none, and then it is a third use
    try:
        with torch.inference_mode(False), torch.enable_grad():
            node = torch.autograd.graph.get_gradient_edge(t).node
            accumulator_was_there = t._use_count() == 2
    except RuntimeError:
        return False
    del node
    return accumulator_was_there


class Slot:
    """Where ``_apply`` will store what the kernel returns: a module's parameter ``key``."""

    __slots__ = ("grad_of", "key", "module")

    def __init__(self, module: torch.nn.Module, key: str, grad_of: torch.Tensor | None) -> None:
        self.module, self.key, self.grad_of = module, key, grad_of


class _StoreOnce(dict):
    """``module._parameters`` until ``_apply`` stores its slot's key: that one store goes
    through ``stored``, which says what the slot keeps, then a plain dict is back."""

    def __init__(self, slot: Slot) -> None:
        super().__init__(slot.module._parameters)
        self.slot = slot

    def cancel(self) -> None:
        """No store is coming (``_apply`` swaps the parameter instead): a plain dict back."""
        self.slot.module.__dict__["_parameters"] = dict(self)

    def stored(self, value: Any) -> Any:
        raise NotImplementedError

    def __setitem__(self, key: str, value: Any) -> None:
        if key != self.slot.key:
            return super().__setitem__(key, value)
        plain = dict(self)
        plain[key] = self.stored(value)
        self.slot.module.__dict__["_parameters"] = plain


class _OneStore(_StoreOnce):
    """The store is recorded for ``src`` (or replaced by the parameter ``src`` is tied
    to)."""

    def __init__(self, slot: Slot, src: torch.Tensor, tied: torch.Tensor | None) -> None:
        super().__init__(slot)
        self.src, self.tied, self.version = src, tied, _written(src)

    def stored(self, value: Any) -> Any:
        if self.tied is not None:
            return self.tied
        if isinstance(value, torch.nn.Parameter) or getattr(value, "_is_param", False):
            _record(self.src, value, self.version)
            # a new Parameter object (the swap could not be made): it takes what the
            # program put on the old one, its hooks too (a review: a hook registered
            # before the move never ran, silently; Note [hooks through a swap])
            if value is not self.src:
                give_state(value, own_state(self.src))
        return value


def own_state(t: torch.Tensor) -> tuple[dict[str, Any], Any, Any]:
    """What the program put on ``t``: its attributes, gradient hooks and post-accumulate
    hooks."""
    from .tensor_copy import program_attributes

    hooks = t._backward_hooks, getattr(t, "_post_accumulate_grad_hooks", None)
    return program_attributes(t), *hooks


def give_state(t: torch.Tensor, state: tuple[dict[str, Any], Any, Any]) -> None:
    attrs, hooks, post = state
    for k, v in attrs.items():
        setattr(t, k, v)
    if hooks:
        t._backward_hooks = hooks
    if post:
        t._post_accumulate_grad_hooks = post


def _written(src: torch.Tensor) -> tuple[int, int]:
    """What moves when ``src`` is written: its version counter, and for a CPU tensor its
    bytes' address (``src.data = other`` replaces them without counting a version). An
    inference tensor counts none (``version_of``: any move of a module inside inference
    mode failed, a review)."""
    return version_of(src), src.data_ptr() if src.device.type == "cpu" else 0


def slot(x: torch.Tensor) -> Slot | None:
    """The module slot ``x`` is being converted for, when a module's move converts one of
    its parameters (or a parameter's gradient); None for a lone tensor or a buffer."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code is not APPLY:
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


def _record(src: torch.Tensor, param: torch.Tensor, version: tuple[int, int]) -> None:
    if _is_local(param):
        key = id(param)
        _recorded_for[key] = weakref.ref(src, lambda _: _recorded_for.pop(key, None))
        _moved[src] = (param, version)
    else:
        _moved[src] = (weakref.ref(param), version)


def _forget(param: torch.Tensor) -> None:
    """``param``, a local Parameter recorded as another's move, is about to be swapped:
    it no longer stands for that one."""
    ref = _recorded_for.pop(id(param), None)
    src = ref() if ref is not None else None
    hit = _moved.get(src) if src is not None else None
    if hit is not None and hit[0] is param:
        del _moved[src]


def _recorded(src: torch.Tensor) -> bool:
    """Whether a move made ``src`` a new Parameter before, which still stands for it."""
    return _standing(src) is not None


def _standing(src: torch.Tensor) -> torch.Tensor | None:
    """The Parameter a move made of ``src``, if it is alive and ``src`` not written since."""
    hit = _moved.get(src)
    if hit is None or hit[1] != _written(src):
        return None
    return hit[0]() if isinstance(hit[0], weakref.ref) else hit[0]


def _tied(src: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """The parameter ``src`` became in an earlier conversion, if it still stands for it."""
    param = _standing(src)
    if param is None:
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


def converted(at: Slot | None, x: torch.Tensor, moved: Any = None) -> None:
    """``x`` was converted for ``at``: remember which parameter the slot receives. A
    remote parameter moved back (``moved``: how its gradient converts) keeps its object
    where it can be swapped (Note [parameters keep their identity])."""
    if at is None or at.grad_of is not None:
        return
    if moved is not None and not _is_local(x) and swaps_back(x):
        at.module.__dict__["_parameters"] = _SwapStore(at, x, moved)
        return
    at.module.__dict__["_parameters"] = _OneStore(at, x, None)


def swaps_back(param: Any) -> bool:
    """Whether a remote ``param`` moving back to a local device may keep its object: a
    Parameter, no weak reference to it, no slots in its class. Its uses are counted when
    ``_apply`` stores (``_SwapStore``): the kernel's own arguments are uses while it runs."""
    return (
        isinstance(param, torch.nn.Parameter)
        and not copyreg._slotnames(type(param))  # type: ignore[attr-defined]
        and not weakref.getweakrefs(param)
    )


class _SwapStore(_StoreOnce):
    """While ``_apply`` moves its remote parameter back: the new ``Parameter`` it stores
    is swapped into the old object, which the slot keeps (Note [parameters keep their
    identity]). The gradient is converted first, here, and taken off the parameter, so
    that ``_apply``, which would set it on its new object, finds none; it is put back on
    the kept one after the swap."""

    def __init__(self, slot: Slot, param: torch.Tensor, moved: Any) -> None:
        super().__init__(slot)
        self.param, self.grad = param, None
        if param.grad is not None:
            self.grad = moved(param.grad)
            param.grad = None

    def stored(self, value: Any) -> Any:
        kept, param = value, self.param
        if swappable(param) and swappable(value):
            # swap_tensors swaps the objects' attributes and tensor hooks too: what the
            # program set on the parameter stays on it (a review: a gradient hook, lost,
            # left the gradient undoubled, silently)
            own = own_state(param)
            torch.utils.swap_tensors(param, value)
            give_state(param, own)
            kept = param
        else:  # an autograd graph still alive saved it: a new Parameter, as before
            _warn_new_parameter(self.slot.module, self.slot.key, back=True)
        if self.grad is not None:
            kept.grad = self.grad
        return kept
