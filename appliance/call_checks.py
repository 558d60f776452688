"""Token ids checked before a registered model runs on a GPU (the model path).

Note [indices on a GPU] (executor/index_bounds.py) checks the graph path's ops. A model
call runs the registered module directly, so its embedding lookups are not ops the
appliance sees one by one: a token id past the vocabulary (a mismatched tokenizer, a
client's crafted request) reached CUDA's ``embedding``, whose device-side assert loses
the worker's context for every session on it (the worker restarts: Note [a lost GPU
context]). On a worker whose device is not the CPU, a call's ``input_ids`` (the keyword,
or the first positional argument when it is an integer tensor) must lie within the
model's input embeddings, and its ``labels`` there too or at ``-100`` (the ignored
label of transformers' losses). Positions past an absolute position table are not
checked here.
"""

from __future__ import annotations

from typing import Any

import torch

from djinn.errors import ExecutionError

IGNORED_LABEL = -100


def _vocabulary(module: Any) -> int | None:
    get = getattr(module, "get_input_embeddings", None)
    try:
        embeddings = get() if callable(get) else None
    except (NotImplementedError, AttributeError):
        return None
    rows = getattr(embeddings, "num_embeddings", None)
    return rows if isinstance(rows, int) else None


def _ids(value: Any) -> torch.Tensor | None:
    """``value`` if it is a non-empty tensor of integers (token ids), else None."""
    if not isinstance(value, torch.Tensor) or not value.numel():
        return None
    integral = not (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool)
    return value if integral else None


def check(module: Any, name: str, args: tuple, kwargs: dict) -> None:
    vocab = _vocabulary(module)
    if vocab is None:
        return
    ids = _ids(kwargs.get("input_ids", args[0] if args else None))
    if ids is not None:
        lo, hi = (int(v) for v in torch.aminmax(ids))
        if lo < 0 or hi >= vocab:
            bad = lo if lo < 0 else hi
            raise ExecutionError(
                f"{name}: input_ids holds token id {bad}, outside the model's vocabulary of {vocab}"
            )
    labels = _ids(kwargs.get("labels"))
    if labels is not None:
        named = labels[labels != IGNORED_LABEL]
        if named.numel():
            lo, hi = (int(v) for v in torch.aminmax(named))
            if lo < 0 or hi >= vocab:
                raise ExecutionError(
                    f"{name}: labels hold {lo if lo < 0 else hi}, outside the model's "
                    f"vocabulary of {vocab} (or -100, ignored)"
                )
