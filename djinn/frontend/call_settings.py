"""Config settings a registered model's forward reads as argument defaults: Note [call
settings]. Used by the model path's calls (remote_module.py)."""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

from djinn.errors import UnsupportedOp
from djinn.protocol.tensors import dtype_name

from . import model_changes
from .device import DEVICE_TYPE, mapped_source


# Note [call settings]: a forward reads some config settings as the default of its argument
# of the same name (model_changes.CALL_SETTINGS: use_cache, output_hidden_states). One the
# program changed since the registration is sent as that argument, where the call did not
# pass it, so the appliance's model, built from the registered config, does what the
# local one would; transformers' Trainer sets ``config.use_cache`` itself, and
# ``Trainer.evaluate()`` was refused (a review). Which modules read it decides (a second
# review): none (ViT, DistilBERT have no such argument) or only modules with a config of
# their own (T5's stacks deep-copy theirs, so eager ignores the top-level change): the
# change does nothing in eager either, and is not sent. Modules sharing the model's config
# (GPT-2, BART, BERT's encoder): sent, through the top-level forward's argument or its
# ``**kwargs``. Both at once, or a forward that cannot take it: refused, typed.
def with_call_settings(
    module: torch.nn.Module, registered: dict[str, Any], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """``kwargs`` with the call settings changed since the registration (``registered``:
    the binding's record of them) that the appliance's model must be given."""
    changed = {
        k: v
        for k, v in model_changes.call_settings(module).items()
        if k not in kwargs and registered and v != registered.get(k)
    }
    sent: dict[str, Any] = {}
    for key, value in changed.items():
        route = _route(module, key)
        if route == "refuse":
            raise UnsupportedOp(
                f"{type(module).__name__} runs on the appliance as it was registered when it "
                f"moved (the model path); since then, its config's {key!r} was changed, and "
                "its forward cannot take it as an argument. Make such changes before the "
                "move (Note [call settings])"
            )
        if route == "send":
            sent[key] = value
    return {**kwargs, **sent} if sent else kwargs


def _route(module: torch.nn.Module, key: str) -> str:
    """send, drop or refuse a changed config setting ``key`` (Note [call settings])."""
    named, open_kwargs = _forward_arguments(type(module))
    readers = [m for m in module.modules() if m is not module and _reads(m, key)]
    shared = [m.config is module.config for m in readers]
    if readers and not any(shared):
        return "drop"  # read only from configs of their own: as eager, which ignores it
    if not readers and key not in named:
        return "drop"  # read nowhere
    if not all(shared) or not (key in named or open_kwargs):
        return "refuse"
    return "send"


def _reads(m: torch.nn.Module, key: str) -> bool:
    """Whether ``m`` reads ``key`` from its config: a module with one whose forward takes
    it (a layer without a config is given the value by the module above it)."""
    if getattr(m, "config", None) is None:
        return False
    named, open_kwargs = _forward_arguments(type(m))
    return key in named or (key == "output_hidden_states" and open_kwargs)  # TransformersKwargs


@functools.lru_cache(maxsize=256)
def _forward_arguments(cls: type) -> tuple[frozenset[str], bool]:
    """The names ``cls.forward`` takes, and whether it takes ``**kwargs`` as well."""
    try:
        parameters = inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return frozenset(), False
    open_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    return frozenset(parameters), open_kwargs


# Note [a model call under autocast]: a registered model's call runs on the appliance, out
# of reach of the client's autocast, and returned float32 logits inside
# ``torch.autocast("cuda", torch.bfloat16)`` where eager's are bfloat16 (a review: 3e-3
# off). So a call made while autocast is on for the remote device (or, under ``djinn
# run``, for the device it maps) says the autocast dtype, and the worker runs the model
# under ``torch.autocast`` of its own device with it (model_handlers.py): a GPU worker's
# is CUDA's policy, what the script gets on a GPU; a CPU worker's the CPU's, what the same
# script gets run on the CPU.
def autocast_dtype() -> str | None:
    """The autocast dtype of a model call made now (None: no autocast)."""
    for kind in (DEVICE_TYPE, mapped_source()):
        if kind is not None and torch.is_autocast_enabled(kind):
            return dtype_name(torch.get_autocast_dtype(kind))
    return None
