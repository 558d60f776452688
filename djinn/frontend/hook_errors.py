"""Python that autograd calls inside ``backward()`` of remote tensors, kept from aborting
the process when it raises.

Note [errors in hooks during backward]: PyTorch runs the backward of remote tensors on
its own device thread, and a Python exception leaving a hook there unwinds through the
engine's stream guard, whose destructor calls the Python device guard's
``exchangeStream``, a ``noexcept`` method that asks Python for the device type, most
likely failing with the hook's error still set: gdb shows ``std::terminate`` there
("terminate called without an active exception"). A review (2026-11-27) found a tensor
hook raising ``1 / 0`` killed the process where CPU eager raises ``ZeroDivisionError``
from ``backward()``; so did a post-accumulate-grad hook. The ops' own errors already
never leave (Note [errors in backward], backward_errors.py); this does the same for the
Python a program gives autograd: tensor hooks and post-accumulate-grad hooks registered
on a remote tensor, a module's full backward hooks and pre-hooks, and a custom
``autograd.Function``'s backward. When one raises on the engine's device thread while
gradients are remote:

- the gradients it would have returned hold the error (Note [failed values]), so what is
  computed from them and every ``.grad`` they reach raise it when read; a
  post-accumulate-grad hook's parameter's ``.grad`` holds it;
- ``backward()`` of a remote tensor raises the exception itself once the engine is done,
  as eager raises it from ``backward()``. (``torch.autograd.backward`` and
  ``torch.autograd.grad`` return, and the gradients raise when read. Two threads in
  ``backward()`` at once may each raise the other's.)

A thread with the engine's multithreading off runs the remote nodes itself, behind the
same guard, and is guarded as the device thread is (Note [an engine started before
Djinn]). Anywhere else (the calling thread, a CPU or CUDA graph) the exception goes as it
would.
A saved-tensors unpack hook (``torch.autograd.graph.saved_tensors_hooks``, and
non-reentrant checkpointing, which recomputes its forward there) is guarded too: as a
hooks object is entered, the pair pushed for autograd keeps a remote tensor's spec
beside what the program's pack made (the object keeps the program's own pair). Not
covered, and still aborting (reviews' probes, ``/tmp/review39b/``, ``/tmp/review39c/``):
hooks registered on a ``grad_fn`` directly (``register_hook``, ``register_prehook``, and
the deprecated ``Module.register_backward_hook``, which uses them); saved-tensor hooks
pushed without a hooks object (``_raw_saved_*.register_hooks``,
``_push_saved_tensors_default_hooks``); an unpack raising for a saved CPU tensor (a
0-dim CPU scalar mixed into a remote op); a pack hook raising inside
``backward(create_graph=True)`` (not guarded: such an exception is often caught by the
Python above it, as checkpointing's ``_StopRecomputationError`` is). A ``backward()``
rooted at a CPU tensor (``y.cpu().sum().backward()``) returns; the remote gradients
raise when read.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch

from . import failures, meta, trace

_lock = threading.Lock()
_raised: list[BaseException] = []  # by hooks inside a backward() that is running
_open = 0  # backward() calls of remote tensors running
_lazy: Any = None  # the LazyTensor class, given by ``attach`` (lazy.py imports this module)


def on_device_thread() -> bool:
    """Whether this thread runs the remote device's backward nodes, inside a backward
    pass: the autograd engine's device thread (a thread Python did not start:
    ``threading`` calls it a dummy), or a thread with the engine's multithreading off,
    which runs them itself behind the same device guard (Note [an engine started before
    Djinn], engine_started.py: a hook raising there aborted the process too)."""
    return torch._C._current_graph_task_id() != -1 and (
        isinstance(threading.current_thread(), threading._DummyThread)
        or not torch._C._is_multithreading_enabled()
    )


def _remote(x: Any) -> bool:
    return _lazy is not None and isinstance(x, _lazy)


def _failed(spec: Any, error: Any) -> Any:
    """A remote tensor of ``spec`` holding ``error`` (Note [failed values])."""
    return _lazy(spec, failures.Failed(error))


def _failed_like(x: Any, error: Any) -> Any:
    """A remote tensor shaped like ``x`` holding ``error``; anything else as it is."""
    return _failed(meta.spec_of(x), error) if _remote(x) else x


def _noted(exc: BaseException, what: str) -> Any:
    """``exc`` kept for the ``backward()`` running, and the error its values hold."""
    with _lock:
        if _open:
            _raised.append(exc)
    return failures.failed_error(what, exc)


def _any_remote(args: tuple) -> bool:
    return any(_remote(a) for a in _flat(args))


def guarded(
    fn: Callable[..., Any],
    what: str,
    fails: Callable[..., Any],
    remote: Callable[[tuple], bool] = _any_remote,
) -> Callable[..., Any]:
    """``fn`` that, raising on the device thread with remote gradients among its
    arguments (``remote(args)``), returns ``fails(error, *args)`` instead (Note [errors in
    hooks during backward])."""

    @functools.wraps(fn)
    def run(*args: Any) -> Any:
        try:
            return fn(*args)
        except BaseException as exc:  # a KeyboardInterrupt raised there aborted as well
            if not on_device_thread() or not remote(args):
                raise
            error = _noted(exc, what)
        try:
            return fails(error, *args)
        except Exception:  # nothing may leave here; backward() raises the hook's error
            return None

    return run


def _flat(args: tuple) -> list[Any]:
    out: list[Any] = []
    for a in args:
        out.extend(a if isinstance(a, (tuple, list)) else (a,))
    return out


def tensor_hook(hook: Callable[..., Any]) -> Callable[..., Any]:
    """A tensor hook: its gradient, failed. What it returns is checked here, as the
    engine would check it (with eager's errors), since the engine's error would abort
    as well."""

    def checked(grad: Any) -> Any:
        out = hook(grad)
        if out is None or not _remote(grad):
            return out
        name = getattr(hook, "__name__", repr(hook))
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"expected Variable, but hook returned '{type(out).__name__}'")
        if (out.dtype, out.device) != (grad.dtype, grad.device):
            raise RuntimeError(
                f"hook '{name}' has changed the type of value (was {grad.dtype} on "
                f"{grad.device} got {out.dtype} on {out.device})"
            )
        if out.shape != grad.shape:
            raise RuntimeError(f"hook '{name}' has changed the size of value")
        return out

    checked = functools.wraps(hook)(checked)
    return guarded(checked, "a tensor's backward hook", lambda error, g: _failed_like(g, error))


def accumulated_hook(hook: Callable[..., Any]) -> Callable[..., Any]:
    """A post-accumulate-grad hook: the parameter's ``.grad``, failed. It must return
    None (checked here, with eager's errors)."""

    def checked(param: Any) -> None:
        out = hook(param)
        if out is not None and _remote(param):
            if isinstance(out, torch.Tensor):
                raise RuntimeError("Tensor post accumulate grad hooks should return None.")
            raise TypeError(f"expected Variable, but hook returned '{type(out).__name__}'")
        return out

    def fails(error: Any, param: Any) -> None:
        grad = param.grad
        if _remote(grad):
            trace.bind(grad, failures.Failed(error))

    checked = functools.wraps(hook)(checked)
    return guarded(checked, "a post-accumulate-grad hook", fails)


def module_hook(hook: Callable[..., Any], pre: bool) -> Callable[..., Any]:
    """A module's full backward hook ``(module, grad_input, grad_output)`` or pre-hook
    ``(module, grad_output)``: the gradients it was given, failed. How many it returns is
    checked here, with ``BackwardHook``'s errors, which would abort where it checks."""

    def checked(module: Any, grads: Any, *rest: Any) -> Any:
        out = hook(module, grads, *rest)
        if out is not None and any(_remote(g) for g in grads):
            got = len(out)  # as BackwardHook counts (a tensor: its first dimension)
            if got != len(grads):
                which = "pre hook" if pre else "hook"
                grad = "grad_output" if pre else "grad_input"
                raise RuntimeError(
                    f"Backward {which} returned an invalid number of {grad}, got {got}, "
                    f"but expected {len(grads)}"
                )
        return out

    def fails(error: Any, _module: Any, grads: Any, *_rest: Any) -> Any:
        return tuple(_failed_like(g, error) for g in grads)

    checked = functools.wraps(hook)(checked)
    return guarded(checked, "a module's backward hook", fails)


def function_backward(apply: Callable[..., Any]) -> Callable[..., Any]:
    """``BackwardCFunction.apply``: each input's gradient, failed, shaped by the graph
    (the leaf it accumulates into, or the metadata of the node it flows to)."""

    def fails(error: Any, ctx: Any, *_grads: Any) -> Any:
        # one gradient per input of the forward (``needs_input_grad``); the graph's edges
        # (``next_functions``) are the tensor inputs', in order, None where no gradient
        edges = iter(node for node in ctx.next_functions if node[0] is not None)
        out: list[Any] = []
        for needed in ctx.needs_input_grad:
            node, index = next(edges) if needed else (None, 0)
            t = getattr(node, "variable", None)
            if t is None and node is not None:
                m = node._input_metadata[index]
                t = torch.empty(m.shape, dtype=m.dtype, device="meta") if _remote_at(m) else None
            out.append(None if t is None else _failed(meta.spec_of(t), error))
        return tuple(out)

    return guarded(apply, "a custom autograd Function's backward", fails)


class _Packed:
    """What a saved-tensors pack hook made of a remote tensor, with the tensor's spec: a
    failed unpack is replaced by a tensor of that spec holding the error."""

    __slots__ = ("inner", "spec")

    def __init__(self, inner: Any, spec: Any) -> None:
        self.inner, self.spec = inner, spec


def saved_tensor_hooks(pack: Callable[..., Any], unpack: Callable[..., Any]) -> tuple:
    """A ``saved_tensors_hooks`` pair as pushed for autograd, guarded for remote tensors
    on the device thread (a raising unpack hook aborted; non-reentrant checkpointing
    recomputes its forward there). The hooks object keeps the program's own pair: code
    that calls ``save_on_cpu().pack_hook`` itself gets what it made."""

    def packed(t: Any) -> Any:
        # not guarded: an exception from a pack hook is caught above it as often as not
        # (checkpointing stops its recomputation so, inside an unpack, on this thread)
        return _Packed(pack(t), meta.spec_of(t)) if _remote(t) else pack(t)

    def checked(x: _Packed) -> Any:
        out = unpack(x.inner)
        if not isinstance(out, torch.Tensor):  # the engine's check, which would abort
            raise TypeError(
                "Output of saved tensor unpack_hook expected to be a Tensor but got result "
                f"of type {type(out).__name__}"
            )
        return out

    guarded_unpack = guarded(  # only a remote tensor's pack is a _Packed
        checked,
        "a saved tensor's unpack hook",
        lambda error, x: _failed(x.spec, error),
        remote=lambda _args: True,
    )

    def unpacked(x: Any) -> Any:
        return guarded_unpack(x) if type(x) is _Packed else unpack(x)

    return functools.wraps(pack)(packed), functools.wraps(unpack)(unpacked)


def _remote_at(m: Any) -> bool:
    return getattr(m.device, "type", None) == torch._C._get_privateuse1_backend_name()


def backward_raising(run: Callable[[], Any]) -> Any:
    """``run()`` (a remote tensor's ``backward()``), then the first exception a guarded
    hook raised meanwhile, as eager raises it from ``backward()``."""
    global _open
    with _lock:
        start = len(_raised)
        _open += 1
    try:
        result = run()
    finally:
        with _lock:
            mine = _raised[start:]
            _open -= 1
            if not _open:
                _raised.clear()
    if mine:
        raise mine[0]
    return result


def attach(lazy: type) -> list[tuple[Any, str, Any]]:
    """Guard what PyTorch calls from Python classes every program shares: a module's
    backward hooks (``BackwardHook``) and custom Functions' backward; what to put back.
    ``lazy``: the LazyTensor class."""
    from torch.autograd.function import BackwardCFunction
    from torch.utils.hooks import BackwardHook

    global _lazy
    _lazy = lazy

    saved = [(BackwardCFunction, "apply", BackwardCFunction.apply)]
    BackwardCFunction.apply = function_backward(BackwardCFunction.apply)
    init = BackwardHook.__init__
    saved.append((BackwardHook, "__init__", init))

    @functools.wraps(init)
    def guarded_init(self: Any, module: Any, user_hooks: Any, user_pre_hooks: Any) -> None:
        init(
            self,
            module,
            [module_hook(h, pre=False) for h in user_hooks],
            [module_hook(h, pre=True) for h in user_pre_hooks],
        )

    BackwardHook.__init__ = guarded_init

    hooks = torch.autograd.graph.saved_tensors_hooks
    enter = hooks.__enter__
    saved.append((hooks, "__enter__", enter))

    @functools.wraps(enter)
    def guarded_enter(self: Any) -> None:
        if not (callable(self.pack_hook) and callable(self.unpack_hook)):
            return enter(self)  # refused there, as PyTorch refuses it
        torch._C._autograd._push_saved_tensors_default_hooks(
            *saved_tensor_hooks(self.pack_hook, self.unpack_hook)
        )
        return None

    hooks.__enter__ = guarded_enter
    return saved


def detach(saved: list[tuple[Any, str, Any]]) -> None:
    for owner, name, value in saved:
        setattr(owner, name, value)
