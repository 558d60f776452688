"""``copy.deepcopy`` of a remote tensor: a copy made on the appliance."""

from __future__ import annotations

import copy

import torch

from . import shared_copies

# the attribute that says whose weight a registered model's meta tensor is: Djinn's, not
# the program's (Note [weights of a registered model], registered_weights.py)
WEIGHT_SOURCE = "_djinn_weight"


def shallow_copy(t: torch.Tensor) -> torch.Tensor:
    """``copy.copy(t)``: as eager's, a new leaf on the same bytes, with ``t``'s
    ``requires_grad`` and attributes. It went through ``__reduce_ex__``, which fetches the
    bytes (for ``torch.save``), and came back a copy of its own: a write through it never
    reached ``t`` (a hunt)."""
    with torch.no_grad():
        new = t.detach()
    new.requires_grad_(t.requires_grad)
    for key, value in program_attributes(t).items():
        setattr(new, key, value)
    return new


def deep_copy(t: torch.Tensor, memo: dict) -> torch.Tensor:
    """A copy made on the appliance (a captured ``clone``), as a CUDA tensor's is made on
    its GPU: ``copy.deepcopy(model)`` of a moved model (a best checkpoint, an EMA copy)
    tried to pickle the session's connection instead."""
    if id(t) in memo:
        return memo[id(t)]
    if not t.is_leaf:
        raise RuntimeError(
            "Only Tensors created explicitly by the user (graph leaves) support the "
            "deepcopy protocol at the moment"
        )  # eager's words
    with torch.no_grad():
        # Note [copies keep shared storage]; a Parameter copies its value alone, as eager's
        new = None if getattr(t, "_is_param", False) else shared_copies.deep_copy_view(t, memo)
        if new is None:
            new = t.clone(memory_format=torch.preserve_format)
    new.requires_grad_(t.requires_grad)
    memo[id(t)] = new
    if getattr(t, "_is_param", False):  # as Parameter.__deepcopy__: the value only
        new._is_param = True
        return new
    if t.grad is not None:
        new.grad = copy.deepcopy(t.grad, memo)
    for key, value in program_attributes(t).items():
        setattr(new, key, copy.deepcopy(value, memo))
    return new


def program_attributes(t: torch.Tensor) -> dict:
    """The attributes the program put on a remote tensor, without its own (the cell of
    its value, its sizes), which a copy or a swap gets anew."""
    return {
        k: v
        for k, v in vars(t).items()
        if k not in ("_b", "_dyn", WEIGHT_SOURCE) and not k.startswith("_sym_")
    }
