"""What a replayable function's call is checked against before it replays: the key of its
arguments, and the state of the modules, optimizers and tensors it used (Note
[replayable functions], replayable.py)."""

from __future__ import annotations

import contextlib
import functools
import inspect
import struct
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from djinn.runtime.remote import RemoteTensor

from . import trace as trace_mod

DEVICE_TYPE = "remote_accelerator"
# what a call may return besides tensors, as recorded: immutable values
PLAIN = (bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)


class Miss(Exception):
    """This call cannot replay or record: ``fn`` runs as it is (the reason is counted).
    ``final``: the key never will."""

    def __init__(self, why: str, final: bool = False) -> None:
        super().__init__(why)
        self.final = final


# -- the key -----------------------------------------------------------------------------
def key(args: tuple, kwargs: dict) -> tuple[Any, list[Any]]:
    """The key of a call, and its remote tensor arguments in order."""
    from .lazy import LazyTensor
    from .session import default_session

    leaves, spec = pytree.tree_flatten((args, kwargs))
    parts: list[Any] = []
    tensors: list[Any] = []
    names: list[Any] = []  # per tensor argument: its handle, else itself (not yet run)
    for x in leaves:
        if isinstance(x, LazyTensor):
            ref = trace_mod.resolved(x._ref)
            name = ref.handle if isinstance(ref, RemoteTensor) else id(x)
            same = next((j for j, n in enumerate(names) if n == name), len(names))
            parts.append(
                (
                    "T",
                    x.dtype,
                    tuple(x.shape),
                    tuple(x.stride()),
                    x.storage_offset(),
                    x.requires_grad,
                    x.is_inference(),
                    same,  # which argument it is the same tensor as (one handle, two names)
                )
            )
            tensors.append(x)
            names.append(name)
        elif isinstance(x, torch.Tensor):
            raise Miss("a local tensor argument (its values would be frozen)")
        else:
            parts.append(_value_key(x))
    mode = (
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        torch.is_autocast_enabled(DEVICE_TYPE),
        torch.get_autocast_dtype(DEVICE_TYPE),
    )
    return (str(spec), tuple(parts), mode, id(default_session())), tensors


def _value_key(x: Any) -> Any:
    """A plain argument by value (a float by its bits: 0.0 and -0.0 differ, a NaN is
    itself); any other object by identity, never held (a module passed in stays the
    caller's to free; what its forward reads is checked by state())."""
    kind = type(x)
    if kind is float:
        return ("f", struct.pack("<d", x))
    if kind is complex:
        return ("c", struct.pack("<dd", x.real, x.imag))
    if x is None or kind in (bool, int, str, bytes, torch.dtype, torch.device):
        return (kind, x)
    return ("id", kind, id(x))


# the hooks a recording may use to see ``step()`` calls (Note [steps a replay would skip])
HOOKS = ((sys.getprofile, sys.setprofile), (sys.gettrace, sys.settrace))


# -- the state it used -------------------------------------------------------------------
class Used:
    """The modules whose forward ran and the optimizers that stepped while a call was
    recorded (PyTorch's global hooks, held for the recording only: RECORDING_HOOKS in
    extension_points.py)."""

    def __init__(self, count: Callable[[], int] = lambda: 0) -> None:
        # held weakly: a module the call made and let go (the CrossEntropyLoss() a
        # transformers head makes at each call) is fn's own Python, not state a replay
        # must find again; it had made every such call record afresh, "a module it used
        # is gone" (State)
        self.modules: dict[int, weakref.ref[torch.nn.Module]] = {}
        self.optimizers: dict[int, torch.optim.Optimizer] = {}
        self.count = count  # ops the recording captured so far
        self.thread = threading.get_ident()  # the recording's
        # each step, in order (Note [optimizer steps run, not replayed] in replay_steps.py)
        self.steps: list[Step] = []
        self.kept: dict[int, dict] = {}  # per optimizer, what it kept as it first stepped
        self.watch: Watch | None = None  # the last recording's state, as this call began
        # Note [steps a replay would skip]: fn's own code objects and the ids of the
        # objects it is a method of; the first ``step()`` the call made of an object a
        # replay would not step
        self.own: frozenset[Any] = frozenset()
        self.owners: frozenset[int] = frozenset()
        self.skipped: str | None = None

    def module_ran(self, module: torch.nn.Module) -> None:
        ref = self.modules.get(id(module))
        if ref is None or ref() is not module:  # new, or a dead one's id reused
            self.modules[id(module)] = weakref.ref(module)

    def stepped(self, opt: torch.optim.Optimizer, with_args: bool = False) -> None:
        if self.watch is not None:
            self.watch.step_began()
        self.optimizers.setdefault(id(opt), opt)
        if id(opt) not in self.kept:  # as it first stepped
            self.kept[id(opt)] = kept_by(opt)
        mine = threading.get_ident() == self.thread
        step = Step(opt, self.count(), with_args or not mine)
        # each parameter's gradient as the step began: what a replay must give it (a ref,
        # not the tensor: holding that would keep alive what the call let go)
        for group in opt.param_groups:
            for p in group["params"]:
                cell = grad_cell(p)  # p held, not weakly: a weakly held tensor cannot be
                step.grads.append((p, getattr(cell, "ref", cell)))  # swapped (swap_tensors)
        self.steps.append(step)

    @contextlib.contextmanager
    def stepping_watched(self, fn: Any) -> Iterator[None]:
        """While ``fn`` records on this thread, every ``step()`` it calls is looked at.

        Note [steps a replay would skip]: a replay runs none of ``fn``'s Python but its
        optimizers' ``step()`` (Note [optimizer steps run, not replayed]), so any other
        object ``fn`` steps is left as it was: two reviews found wrong numbers with no
        error from a Lookahead that never starts as an ``Optimizer`` (its count and slow
        weights; PyTorch's hooks see only the inner step) and from a ``StepLR`` stepped
        inside ``fn`` (its learning rate is the same for three calls in a row, so the
        recordings agree; a replay never decays it). So while a call records, a
        profile function sees each Python call (``sys.setprofile``, this thread, a few
        calls per key: 10-20% more per recording call): a method named ``step`` of an
        object that is neither a module, an optimizer whose step PyTorch's hooks began,
        nor an object ``fn`` is a method of, outside ``fn``'s own code, makes
        the call run as it is, for good, with ``stats()["plain"]`` naming it. A
        scheduler, a diffusion sampler's ``step``, ``GradScaler.step`` all count. What a
        hooked optimizer keeps in plain attributes (a Lookahead subclass's count) is
        compared by ``kept_by``: changed, its ``step()`` runs at each replay. While a
        profiler holds the profile hook (``cProfile``), the trace hook is used instead;
        while both are held (a profiler and a debugger or coverage), the check is not
        made, and they are left alone. A profiler installed from C without a Python
        object (``sys.getprofile()`` None: yappi) is replaced for the recording."""
        # a profile function, or a trace function if a profiler (cProfile) holds that
        # hook: its ``call`` events are the same, and it returns None, tracing no line
        free = next(((g, p) for g, p in HOOKS if g() is None), None)
        if free is None:
            yield
            return
        get, put = free
        self.own, self.owners = own_code(fn)
        put(self._profile)
        try:
            yield
        finally:
            if get() == self._profile:
                put(None)

    def _profile(self, frame: Any, event: str, _arg: Any) -> None:
        """Note [steps a replay would skip]: a call of a method named ``step`` of an
        object that is neither an optimizer stepping now (PyTorch's hooks began its step)
        nor a module, outside ``fn``'s own code, is Python a replay would not run."""
        if event != "call" or self.skipped is not None:
            return
        code = frame.f_code
        if code.co_name != "step" or not code.co_argcount or code in self.own:
            return
        try:  # a profile function's error would be raised in the program
            self._stepped_object(frame, code)
        except Exception:  # then it is not a step it can name
            return

    def _stepped_object(self, frame: Any, code: Any) -> None:
        obj = frame.f_locals.get(code.co_varnames[0])
        if obj is None or isinstance(obj, torch.nn.Module) or id(obj) in self.owners:
            return
        if isinstance(obj, torch.optim.Optimizer) and any(
            s.opt is obj and s.end is None for s in self.steps
        ):
            return
        method = inspect.unwrap(getattr(type(obj), "step", None) or (lambda: None))
        if getattr(method, "__code__", None) is code:  # the object's own step
            self.skipped = f"{type(obj).__qualname__}.step"

    def frozen(self) -> bool:
        """Whether a step changed what an optimizer keeps in Python (a step count in a CPU
        tensor): a replay of the whole call would freeze it. What a first step makes is
        not a change."""
        for opt in self.optimizers.values():
            before, after = self.kept.get(id(opt), {}), kept_by(opt)
            if any(k in after and after[k] != v for k, v in before.items()):
                return True
        return False

    def step_done(self, opt: torch.optim.Optimizer) -> None:
        if self.watch is not None:
            self.watch.step_ended()
        for step in reversed(self.steps):
            if step.opt is opt and step.end is None:
                step.end = self.count()
                return


@dataclass
class Step:
    """One optimizer step while a call recorded: the ops captured before it began and
    when it ended; ``odd`` if it took arguments (a closure) or ran on another thread."""

    opt: torch.optim.Optimizer
    start: int
    odd: bool
    end: int | None = None
    # per parameter, its gradient as the step began: None, or what its binding held
    grads: list[tuple[Any, Any]] = field(default_factory=list)


def grad_cell(p: torch.Tensor) -> Any:
    """What ``p.grad`` is: None, the Binding of a remote gradient (Note [bindings]: a new
    one when ``.grad`` is assigned), or a local tensor."""
    grad = p._grad
    return None if grad is None else grad.__dict__.get("_b", grad)


class Watch:
    """What the last recording of a key used, as it is when a new call of the key begins:
    what the call itself changes shows against it. A replay runs none of ``fn``'s Python,
    so it could not make those changes (a scheduler stepped inside ``fn``, a count an
    optimizer keeps in Python, a ``.grad`` cleared or assigned)."""

    def __init__(self, whole: State | None, before_steps: State | None) -> None:
        self.whole, self.before_steps = whole, before_steps
        self.start = None if whole is None else whole.now(hooks=False)
        self.start_split = None if before_steps is None else before_steps.now(hooks=False)
        self.around: list[tuple | None] = []  # as each step began and ended, in turn
        self._depth = 0  # steps under way (a subclass's step() calling super().step())
        state = whole if whole is not None else before_steps
        params = [] if state is None else state.parameters()
        self.grads = {id(p): (p, where, grad_cell(p)) for p, where in params}

    def step_began(self) -> None:
        self._depth += 1
        if self._depth == 1 and self.before_steps is not None:
            self.around.append(self.before_steps.now(hooks=False))

    def step_ended(self) -> None:
        self._depth -= 1
        if self._depth == 0 and self.before_steps is not None:
            self.around.append(self.before_steps.now(hooks=False))

    def changed(self) -> bool:
        """Whether the call changed the state its whole replay would be checked by."""
        return self.whole is not None and self.whole.now(hooks=False) != self.start

    def changed_outside_steps(self) -> bool:
        """Whether the call changed, other than in its optimizer steps (which a replay
        runs), the state a replay of its ops before them would be checked by: before
        them (a learning rate), between them or after them (a scheduler stepped)."""
        if self.before_steps is None:
            return False
        seen = [self.start_split, *self.around, self.before_steps.now(hooks=False)]
        return any(seen[i] != seen[i + 1] for i in range(0, len(seen) - 1, 2))


def kept_by(opt: torch.optim.Optimizer) -> dict[tuple[Any, Any], Any]:
    """What an optimizer keeps per parameter, as the state check compares it, and its
    own plain attributes (a wrapper's step count: Note [steps a replay would skip])."""
    kept: dict[tuple[Any, Any], Any] = {
        (id(p), k): _hyper(v) for p, entries in opt.state.items() for k, v in entries.items()
    }
    for name, value in vars(opt).items():
        if type(value) in (int, float, bool, str):
            kept[("attr", name)] = value
    return kept


def own_code(fn: Any) -> tuple[frozenset[Any], frozenset[int]]:
    """The code objects of ``fn`` itself, through what wraps it (decorators that keep
    ``__wrapped__``, ``functools.partial``, a bound method, a callable object's
    ``__call__``, a module's ``forward``), and the ids of the objects it is a method of:
    their own ``step()`` (a trainer's helper) is ``fn``'s Python too."""
    codes: set[Any] = set()
    owners: set[int] = set()
    for _ in range(16):
        code = getattr(fn, "__code__", None)
        if code is not None:
            codes.add(code)
        if hasattr(fn, "__wrapped__"):
            fn = fn.__wrapped__
        elif isinstance(fn, functools.partial):
            fn = fn.func
        elif hasattr(fn, "__func__"):
            owners.add(id(getattr(fn, "__self__", None)))
            fn = fn.__func__
        elif code is None and isinstance(fn, torch.nn.Module):
            owners.add(id(fn))
            fn = type(fn).forward
        elif code is None and callable(fn):
            owners.add(id(fn))
            fn = type(fn).__call__
        else:
            break
    return frozenset(codes), frozenset(owners)


def named_tensors(fn: Any) -> list[Any]:
    """Remote tensors ``fn`` names: in its closure or, by a name its code reads, in its
    globals (a weight a lambda closes over)."""
    from .lazy import LazyTensor

    fn = getattr(fn, "func", fn)  # functools.partial
    fn = getattr(fn, "__func__", fn)  # a bound method
    found: list[Any] = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # a cell not yet filled
            continue
        if isinstance(value, LazyTensor):
            found.append(value)
    code, names = getattr(fn, "__code__", None), getattr(fn, "__globals__", {})
    for name in getattr(code, "co_names", ()):
        if isinstance(value := names.get(name), LazyTensor):
            found.append(value)
    return found


def tensor_state(t: torch.Tensor) -> tuple:
    """Which tensor object, bound to which value (Note [bindings]: a swap, ``.data =``,
    reassignment change it), and whether it wants gradients."""
    return (id(t), id(t.__dict__.get("_b")), t.requires_grad)


def _hooks(t: torch.Tensor) -> tuple:
    return (
        len(getattr(t, "_backward_hooks", None) or ()),
        len(getattr(t, "_post_accumulate_grad_hooks", None) or ()),
    )


def module_state(m: torch.nn.Module) -> tuple:
    """What of a module changes what its forward computes without a tensor changing in
    place: its train/eval flag, its hooks, its own parameters and buffers (and theirs),
    and which modules are its children (one swapped in: ``model[2] = head``)."""
    own = [*m._parameters.values(), *m._buffers.values()]
    return (
        m.training,
        tuple(id(c) for c in m._modules.values()),
        len(m._forward_hooks),
        len(m._forward_pre_hooks),
        len(m._backward_hooks),
        len(m._backward_pre_hooks),
        tuple((tensor_state(t), _hooks(t)) if t is not None else None for t in own),
    )


def optimizer_state(opt: torch.optim.Optimizer, kept: bool = True) -> tuple:
    """An optimizer's parameters and their state tensors (a ``load_state_dict`` or a
    cleared state replaces them), its hooks, and its hyperparameters: Python values (a
    scheduler's learning rate) by value, a CPU tensor by its values. ``kept=False``: not
    its state (an optimizer whose step runs at every call: its step count changes)."""
    return (
        len(getattr(opt, "_optimizer_step_pre_hooks", ())),
        len(getattr(opt, "_optimizer_step_post_hooks", ())),
        tuple(
            (
                tuple(tensor_state(p) for p in group["params"]),
                tuple((k, _hyper(v)) for k, v in sorted(group.items()) if k != "params"),
                tuple(
                    tuple((k, _hyper(v)) for k, v in sorted(opt.state.get(p, {}).items()))
                    for p in group["params"]
                )
                if kept
                else (),
            )
            for group in opt.param_groups
        ),
    )


def _hyper(v: Any) -> Any:
    """A hyperparameter or state entry as the check compares it."""
    from .lazy import LazyTensor

    if isinstance(v, LazyTensor):
        return tensor_state(v)  # read by the graph as it is: its identity is what counts
    if isinstance(v, torch.Tensor):
        return ("cpu", id(v), tuple(v.reshape(-1).tolist()) if v.numel() <= 64 else id(v))
    if isinstance(v, tuple):
        return tuple(_hyper(x) for x in v)
    return v if v is None or type(v) in PLAIN else ("id", type(v), id(v))


def global_hooks() -> tuple:
    """PyTorch's process-wide module and optimizer hooks (none of Djinn's own is held
    while this is compared)."""
    from torch.nn.modules import module as m
    from torch.optim import optimizer as o

    return tuple(
        len(getattr(mod, name, ()))
        for mod, name in (
            (m, "_global_forward_hooks"),
            (m, "_global_forward_pre_hooks"),
            (m, "_global_backward_hooks"),
            (m, "_global_backward_pre_hooks"),
            (o, "_global_optimizer_pre_hooks"),
            (o, "_global_optimizer_post_hooks"),
        )
    )


class State:
    """The state a recording used, checked again before each replay."""

    def __init__(self, used: Used, named: list[Any], kept: bool = True) -> None:
        """``kept=False``: what the optimizers that stepped keep is left out (their steps
        run at every call: Note [optimizer steps run, not replayed] in replay_steps.py);
        their hyperparameters are not (``fn`` may read them before them)."""
        self._modules = [r for r in used.modules.values() if r() is not None]
        self._optimizers = [weakref.ref(o) for o in used.optimizers.values()]
        self._kept = kept
        self._named = named  # the closure's tensors: alive as long as fn is
        self.value = self.now()

    def now(self, hooks: bool = True) -> tuple | None:
        """The state as it is now; None if a module or optimizer it used is gone.
        ``hooks=False``: without PyTorch's global hooks (Djinn's own are held while a call
        records)."""
        modules = [r() for r in self._modules]
        optimizers = [r() for r in self._optimizers]
        if any(m is None for m in modules) or any(o is None for o in optimizers):
            return None
        return (
            tuple(module_state(m) for m in modules),
            tuple(optimizer_state(o, self._kept) for o in optimizers),
            tuple(tensor_state(t) for t in self._named),
            global_hooks() if hooks else (),
        )

    def same(self) -> bool:
        return self.now() == self.value

    def parameters(self) -> list[tuple[torch.Tensor, tuple]]:
        """The parameters of its modules and optimizers, each once, with where it is held
        (``param_at``)."""
        seen: dict[int, tuple[torch.Tensor, tuple]] = {}
        for r in self._modules:
            m = r()
            if m is not None:
                for name, p in m._parameters.items():
                    if p is not None:
                        seen.setdefault(id(p), (p, (r, name)))
        for r in self._optimizers:
            o = r()
            if o is not None:
                for i, g in enumerate(o.param_groups):
                    for j, p in enumerate(g["params"]):
                        seen.setdefault(id(p), (p, (r, i, j)))
        return list(seen.values())

    def tensors(self) -> set[int]:
        """ids of the tensors it names: the modules' and optimizers' and the closure's."""
        out = {id(t) for t in self._named}
        for r in self._modules:
            m = r()
            if m is not None:
                out.update(id(t) for t in [*m._parameters.values(), *m._buffers.values()])
        for r in self._optimizers:
            o = r()
            if o is not None:
                out.update(id(p) for g in o.param_groups for p in g["params"])
        return out


def param_at(where: tuple) -> torch.Tensor | None:
    """The parameter a module holds under a name, or an optimizer at a place in its
    groups (held weakly: a record keeps no dropped model alive, and a tensor held weakly
    could not be swapped); None once it is gone."""
    owner = where[0]()
    if owner is None:
        return None
    if isinstance(owner, torch.nn.Module):
        return owner._parameters.get(where[1])
    groups = owner.param_groups
    i, j = where[1], where[2]
    return groups[i]["params"][j] if i < len(groups) and j < len(groups[i]["params"]) else None
