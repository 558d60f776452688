"""The dtype of the statistics normalization kernels save, as a CPU's kernels make them:
one rule for the client's capture and the worker's check of what an op returned.

Note [statistics dtypes]: ``native_layer_norm`` and the batch norm kernels return, beside
their output, the mean and inverse deviation autograd saves for backward. Their meta
kernels follow CUDA: float32 for a bfloat16 or float16 input. The CPU kernels keep the
input's dtype, unless the parameters are float32 ("mixed type": then float32). Both
sides took meta's dtype (the worker casts a result to it, Note [meta dtypes]), so a CPU
worker stored float32 statistics, and its backward kernel refused them ("expected scalar
type BFloat16 but found Float"): a bfloat16 ``LayerNorm`` or ``BatchNorm2d`` could not
train. On a CPU worker both sides now take the CPU kernels' dtype; on a GPU, meta's is
CUDA's.
"""

from __future__ import annotations

from typing import Any

import torch

_aten = torch.ops.aten
OPS = frozenset(
    {
        _aten.native_layer_norm.default,
        _aten.native_batch_norm.default,
        _aten._native_batch_norm_legit.default,
        _aten._native_batch_norm_legit.no_stats,
        _aten._native_batch_norm_legit_no_training.default,
        _aten._batch_norm_with_update.default,
        _aten._batch_norm_no_update.default,
    }
)
STATISTICS = (1, 2)  # the positions of the saved mean and inverse deviation in the outputs
# the parameters whose dtype makes a call "mixed type", by argument name
_PARAMS = ("weight", "bias", "running_mean", "running_var")


def cpu_dtype(op: Any, args: Any, kwargs: dict[str, Any]) -> torch.dtype | None:
    """The dtype a CPU kernel gives ``op``'s saved statistics where it is not meta's
    (a bfloat16 or float16 input); None otherwise (Note [statistics dtypes])."""
    if op not in OPS:
        return None
    x = args[0] if args else kwargs.get("input")
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.bfloat16, torch.float16):
        return None
    given = dict(zip((a.name for a in op._schema.arguments), args, strict=False)) | kwargs
    first = next((given[n] for n in _PARAMS if isinstance(given.get(n), torch.Tensor)), None)
    return torch.float32 if first is not None and first.dtype != x.dtype else x.dtype
