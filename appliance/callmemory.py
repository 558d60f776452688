"""What a model call will add to device memory, known before it runs (issue 16 §4).

A decoder's KV cache grows by a fixed number of bytes per token: 2 (keys and values) x
layers x key/value heads x head size x element size, per batch row. The worker reserves
that growth *before* executing, so a call that would overflow device memory is refused
(or makes room by eviction) before the allocator ever sees it; after the call the
reservation is swapped for the bytes actually held.

Estimates come from the model's config only. A model whose config does not say how its
cache grows is estimated at 0 and charged after the call, as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from djinn.protocol.frames import WEIGHTS_METHOD

DEFAULT_NEW_TOKENS = 20  # transformers' generate() default when no length is given


@dataclass(frozen=True)
class CallGrowth:
    """Bytes a call will add: ``data`` stays after it (a KV cache passed back to the
    client, logits), ``stack`` lives only while it runs (generate()'s internal cache)."""

    data: int = 0
    stack: int = 0


def _int(config: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if type(value) is int and value > 0:
            return value
    return None


def kv_bytes_per_token(module: torch.nn.Module) -> int:
    """Cache bytes one token adds for one batch row; 0 when the config does not say."""
    config = getattr(module, "config", None)
    layers = _int(config, "num_hidden_layers", "n_layer")
    heads = _int(config, "num_attention_heads", "n_head")
    hidden = _int(config, "hidden_size", "n_embd")
    if config is None or layers is None or heads is None or hidden is None:
        return 0
    kv_heads = _int(config, "num_key_value_heads") or heads
    head_dim = _int(config, "head_dim") or hidden // heads
    param = next(iter(module.parameters()), None)
    elem = param.element_size() if param is not None and param.is_floating_point() else 4
    return 2 * layers * kv_heads * head_dim * elem


def _tokens(args: list[Any], kwargs: dict[str, Any]) -> tuple[int, int] | None:
    """(batch, new tokens) of a call's input ids or embeddings."""
    x = kwargs.get("input_ids")
    if x is None:
        x = kwargs.get("inputs_embeds")
    if x is None and args and isinstance(args[0], torch.Tensor):
        x = args[0]
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        return None
    return int(x.shape[0]), int(x.shape[1])


def _logit_bytes(module: torch.nn.Module) -> int:
    """Bytes of one token's logits for a model with an output head (0 without one)."""
    head = getattr(module, "get_output_embeddings", None)
    out = head() if callable(head) else None
    weight = getattr(out, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return 0
    return int(weight.shape[0]) * weight.element_size()


def estimate(
    module: torch.nn.Module, method: str, args: list[Any], kwargs: dict[str, Any]
) -> CallGrowth:
    if method == WEIGHTS_METHOD:  # a copy of each weight (Note [a registered model trains])
        tensors, names = own_tensors(module), kwargs.get("names")
        return CallGrowth(
            data=sum(tensors[n].nbytes for n in (tensors if names is None else names))
        )
    shape = _tokens(args, kwargs)
    per_token = kv_bytes_per_token(module)
    if shape is None:
        return CallGrowth()
    batch, new = shape
    if method == "generate":
        rows = batch * max(1, int(kwargs.get("num_beams") or 1))
        rows *= max(1, int(kwargs.get("num_return_sequences") or 1))
        total = kwargs.get("max_length")
        if not isinstance(total, int):
            more = kwargs.get("max_new_tokens")
            total = new + (more if isinstance(more, int) else DEFAULT_NEW_TOKENS)
        # the cache lives inside generate() and is dropped when it returns
        return CallGrowth(stack=rows * total * per_token)
    config = getattr(module, "config", None)
    use_cache = kwargs.get("use_cache", getattr(config, "use_cache", False))
    kv = batch * new * per_token if use_cache else 0
    return CallGrowth(data=kv + batch * new * _logit_bytes(module))


def own_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer once, by its first name (a tied weight is one tensor)."""
    out = dict(module.named_parameters())
    out.update(module.named_buffers())
    return out
