"""What a registered model's call does about autograd (Note [no autograd on the model
path]): the warning that its outputs carry none, and the calls that ask for it."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from . import ties


# Note [no autograd on the model path]: the model path runs a registered model for
# inference; its outputs carry no autograd. Eager's, from an eval-mode model called with
# gradients on and parameters that require them (fine-tuning with dropout off, a saliency
# map), have a ``grad_fn``, and ``backward()`` here raised only PyTorch's "element 0 of
# tensors does not require grad". Refusing such calls would refuse every inference call
# made without ``torch.no_grad()``, so the first one warns, once per model, saying why and
# what to do. But a call given a tensor that requires grad (``inputs_embeds`` of a saliency
# map, an adversarial input) asks for gradients through the model: its outputs had none,
# and a loss that added a term of that input's own got a gradient with the model's part
# missing, with only that warning (a hunt: 4e-4 off eager's). Such a call takes the model
# off the model path, as ``.train()`` would (Note [a registered model trains]), in its own
# mode (dropout stays off), and runs on the graph path with autograd, saying so once.
def wants_grad(args: tuple, kwargs: dict) -> bool:
    """Whether a tensor among the call's arguments (or in a list of them) requires grad."""
    for v in (*args, *kwargs.values()):
        for t in v if type(v) in (list, tuple) else (v,):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                return True
    return False


def say_leaving(module: torch.nn.Module) -> None:
    """Warn that a call with an input that requires grad takes ``module`` off the path."""
    warnings.warn(
        f"{type(module).__name__} was called with an input that requires grad, with "
        "gradients on: it leaves the appliance's model path (its weights are copied into "
        "the session) and runs op by op on the graph path, whose outputs carry autograd as "
        "eager's do (Note [no autograd on the model path])",
        stacklevel=ties._callers_level(),
    )


def say_no_grad(module: torch.nn.Module, binding: Any) -> None:
    """Warn, once per model, that its outputs carry no autograd (``binding``: its
    ``_RemoteBinding``, which remembers that it was told)."""
    binding.told_no_grad = True
    if any(p.requires_grad for p in module.parameters()):
        warnings.warn(
            f"{type(module).__name__} runs on the appliance's model path (it moved in eval "
            "mode): its outputs carry no autograd, unlike eager's with gradients enabled. "
            "Run inference under torch.no_grad() to say so; to train it or take gradients "
            "through it, call model.train(): its next call takes its weights into the "
            "session and runs on the graph path (Note [a registered model trains]); "
            "model.eval() after that turns dropout off (Note [no autograd on the model "
            "path])",
            stacklevel=4,
        )
