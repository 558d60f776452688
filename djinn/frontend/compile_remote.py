"""``torch.compile`` of code that makes remote tensors (Note [torch.compile and remote values]).

Note [torch.compile and remote values]: dynamo breaks its graph at each op that takes a
remote tensor and runs that op as it is (Note [dynamo skips djinn]). Two places in
PyTorch still met a remote value unprepared, and ``torch.compile`` of a graph-path GPT-2
raised at its first call:

- an op that only *makes* a remote tensor, a factory such as ``torch.arange(n,
  device=remote)`` (GPT-2's cache positions), has no remote input to break at. The graph
  it ends up in went to inductor, which has no code generation for Djinn's device:
  ``InductorError: KeyError: 'remote_accelerator'``. Inductor has no kernels to write for
  it (the appliance plans and compiles what it is sent: Note [compiled plans]), so
  ``compile_fx``, inductor's entry point, is wrapped: a graph with a value or an example
  input on the remote device runs as dynamo captured it (its ``forward``: each op
  captured as any other), and any other graph goes to inductor as before;
- dynamo clones a real tensor it meets as an example value (``utils.clone_input``) into
  a fresh buffer reshaped in place (``as_strided_``), which Djinn refuses on a remote
  tensor (it changes a tensor's shape in place): ``UnsupportedOp``. For a remote tensor
  the wrapper clones it with ``torch.clone``, as dynamo itself does for XLA's tensors
  and for tensor subclasses it can trace.

Both wrappers leave every other value to PyTorch's own code. Neither module is imported
by ``import djinn`` (seconds each): the wrappers go on when they are imported
(``when_loaded``), and a torch whose functions moved is left as it is.
``torch.compile`` then runs such a model with local eager's numbers (the test compares a
GPT-2's logits); what it gains is on the local side only.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree

from .device import DEVICE_TYPE
from .on_import import forget, when_loaded

log = logging.getLogger("djinn.frontend")

_COMPILE_FX = "torch._inductor.compile_fx"
_DYNAMO_UTILS = "torch._dynamo.utils"
_BUILDER = "torch._dynamo.variables.builder"  # imports clone_input by name


def _remote(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == DEVICE_TYPE


def makes_remote(gm: Any, example_inputs: Any) -> bool:
    """Whether the dynamo graph ``gm`` (or its ``example_inputs``) holds a remote value."""
    if any(_remote(x) for x in _pytree.tree_leaves(list(example_inputs))):
        return True
    for node in gm.graph.nodes:
        for key in ("example_value", "val"):
            if any(_remote(x) for x in _pytree.tree_leaves(node.meta.get(key))):
                return True
        device = node.kwargs.get("device")
        if isinstance(device, (str, torch.device)) and torch.device(device).type == DEVICE_TYPE:
            return True
    return False


def compile_fx_for(original: Callable[..., Any]) -> Callable[..., Any]:
    """Inductor's ``compile_fx``, but a graph holding remote values runs as it is."""

    @functools.wraps(original)
    def compile_fx(model_: Any, example_inputs_: Any, *args: Any, **kwargs: Any) -> Any:
        if makes_remote(model_, example_inputs_):
            return model_.forward
        return original(model_, example_inputs_, *args, **kwargs)

    compile_fx.djinn_original = original  # type: ignore[attr-defined]
    return compile_fx


def clone_input_for(original: Callable[..., Any]) -> Callable[..., Any]:
    """Dynamo's ``clone_input``, but a remote tensor is cloned by ``torch.clone``."""

    @functools.wraps(original)
    def clone_input(x: Any, *, dtype: Any = None) -> Any:
        if not _remote(x):
            return original(x, dtype=dtype)
        with torch.no_grad():
            y = torch.clone(x if dtype is None else x.to(dtype))
        if x.is_leaf:
            y.requires_grad_(x.requires_grad)
        return y

    clone_input.djinn_original = original  # type: ignore[attr-defined]
    return clone_input


def _wrap(module: Any, name: str, wrapper: Callable[..., Any]) -> Any:
    """``module.name`` wrapped (and the original returned), unless it is already."""
    try:
        original = getattr(module, name)
        if getattr(original, "djinn_original", None) is not None:
            return None
        setattr(module, name, wrapper(original))
    except Exception:  # a torch whose internals moved: compiling raises as it did
        log.debug("djinn: could not wrap %s.%s", module.__name__, name, exc_info=True)
        return None
    return original


def _unwrap(module: Any, name: str, original: Any) -> None:
    wrapper = getattr(module, name, None) if module is not None else None
    if original is not None and getattr(wrapper, "djinn_original", None) is original:
        setattr(module, name, original)


def _wrap_clone_input(utils: Any) -> Any:
    original = _wrap(utils, "clone_input", clone_input_for)
    builder = sys.modules.get(_BUILDER)  # dynamo loaded before djinn: its copy, too
    if original is not None and builder is not None and builder.clone_input is original:
        builder.clone_input = utils.clone_input
    return original


def attach() -> Any:
    """Wrap both, now or once each module is imported."""
    return (
        when_loaded(_COMPILE_FX, lambda m: _wrap(m, "compile_fx", compile_fx_for)),
        when_loaded(_DYNAMO_UTILS, _wrap_clone_input),
    )


def detach(state: Any) -> None:
    """Undo ``attach``: the finders taken out, or PyTorch's own functions put back."""
    compile_fx, clone_input = state
    module, original = forget(compile_fx)
    _unwrap(module, "compile_fx", original)
    module, original = forget(clone_input)
    _unwrap(module, "clone_input", original)
    _unwrap(sys.modules.get(_BUILDER), "clone_input", original)
