"""``scaled_dot_product_attention`` on the remote device: the kernel local eager would use.

Note [fused attention]: ``F.scaled_dot_product_attention`` picks its kernel by device
type, through a C++ dispatch stub that only CPU and CUDA fill. On ``remote_accelerator``
it found none and fell back to the math decomposition: about 30 captured ops per call
(``bmm``, ``expand``, ``clone``, a causal mask built with ``tril`` and ``where``,
``_safe_softmax``...) where local eager on a CPU runs one fused flash-attention kernel.
A GPT-2 forward (``benchmarks/capture.py``) captured 807 ops, 507 with the fused kernel,
and its attention ran other kernels than local eager's, with other rounding.

So the remote device gets its own kernel for the op, on the autograd key (the op is
composite: below autograd it would already be decomposed). When local eager on a CPU
would take the flash kernel and the session's worker is a CPU worker, it captures that
kernel, ``_scaled_dot_product_flash_attention_for_cpu``, as one op, and in training its
backward as one op too (the kernel's own derivative): no dropout, a query, key and value
the kernel can read safely, and an ``attn_mask`` only of the shapes eager hands the kernel,
not requiring grad (``djinn/protocol/flash_attention.py``; the appliance refuses any other,
Note [op validation]). A bool mask becomes the additive one eager makes of it (zeros, -inf
where masked). Anything else takes PyTorch's own composite path, as before. (Masked calls
took the composite path until the appliance knew how the kernel reads a mask: BERT's and
GPT-2's padding masks were 1e-7 off eager, T5's position bias 2.7e-5 after 3 AdamW steps.)

Capture takes the output's strides from PyTorch's meta kernel (``empty_like(query)``);
the CPU kernel lays its output out the same way, following the query, so a ``view``
decided on the client holds on the worker (the tests compare the strides with local
eager's for a contiguous, a permuted and a split query).
"""

from __future__ import annotations

from typing import Any

import torch

from djinn.protocol import flash_attention

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Any:
    # with enable_gqa, eager hands the CPU kernel the key and value as they are, fewer
    # heads than the query (it reads one per group): transformers asks for it whenever a
    # Llama-family model has no mask, and the composite path (the key repeated per head)
    # was 7.8e-3 off in bfloat16 (a review). Without it, eager fails on unequal heads.
    heads_ok = enable_gqa or query.shape[-3:-2] == key.shape[-3:-2]
    fused = heads_ok and _mask_fused(attn_mask, query, key)
    if fused and _fused(query, key, value, dropout_p):
        mask = _additive(attn_mask, query.dtype) if attn_mask is not None else None
        return _FLASH_CPU(query, key, value, dropout_p, is_causal, attn_mask=mask, scale=scale)[0]
    return _SDPA.decompose(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
    )


def _mask_fused(mask: Any, q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether local eager would hand ``mask`` to the flash kernel: none, or one of the
    shapes it takes (not 3-D: the math path), bool or the query's dtype, not requiring
    grad (the math path too, for its gradient)."""
    if mask is None:
        return True
    if not isinstance(mask, torch.Tensor) or mask.requires_grad:
        return False
    additive = q.dtype if mask.dtype == torch.bool else None  # as _additive makes it
    return flash_attention.mask_refusal(mask, q, k, additive) is None


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask as the additive one eager makes of it for the CPU kernel (zeros, -inf
    where a position may not be attended: ``convert_boolean_attn_mask_cpu``)."""
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask.logical_not(), float("-inf"))


def _fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> bool:
    if dropout_p != 0.0 or not torch.backends.cuda.flash_sdp_enabled():
        return False  # (PyTorch's switch for flash attention covers the CPU kernel too)
    return flash_attention.refusal(q, k, v) is None and _worker_is_cpu()


def _worker_is_cpu() -> bool:
    """Whether the process's default session runs on a CPU worker. It is opened if there is
    none yet: a program's first attention call often comes before any request (the
    tensors it read went inline), and deciding without a session sent it down the
    composite path, with other numbers than local eager's fused kernel."""
    from .session import current_device_type

    return current_device_type(start=True) == "cpu"
