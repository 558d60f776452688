"""Autocast on the remote device, with CUDA's policy.

PyTorch ships autocast kernels for CPU, CUDA and a few others, but none for PrivateUse1:
``torch.autocast("remote_accelerator")`` would make every op fail with "Could not run ...
with arguments from the 'Autocastremote_accelerator' backend". ``policy`` is registered as
kernels on the ``AutocastPrivateUse1`` key for each listed op, and every other op falls
through (Note [autocast policy]).

Note [autocast policy]: the op lists are CUDA's (``aten/src/ATen/autocast_mode.cpp``), so
a script written for ``torch.autocast("cuda")`` computes what it would on a GPU: matmuls
and convolutions in the autocast dtype, numerically sensitive ops (norms, losses,
softmax, reductions) in float32, a few binary ops at their widest input type, every other
op untouched. Autocast keys sit above autograd, so the composite ops (``linear``,
``conv2d``, ``softmax``) arrive here whole, before they are decomposed. The key is only
active while autocast is enabled for the device, so the fallback costs nothing otherwise.
"""

from __future__ import annotations

from typing import Any

import torch

from .device import DEVICE_TYPE

_KEY = torch._C.DispatchKey.AutocastPrivateUse1

LOWER_PRECISION = frozenset(
    [
        "_convolution",
        "conv1d",
        "conv2d",
        "conv3d",
        "conv_tbc",
        "conv_transpose1d",
        "conv_transpose2d",
        "conv_transpose3d",
        "convolution",
        "prelu",
        "addmm",
        "addmv",
        "addr",
        "matmul",
        "einsum",
        "mm",
        "mv",
        "linalg_vecdot",
        "linear",
        "addbmm",
        "baddbmm",
        "bmm",
        "chain_matmul",
        "linalg_multi_dot",
        "_thnn_fused_lstm_cell",
        "_thnn_fused_gru_cell",
        "lstm_cell",
        "gru_cell",
        "rnn_tanh_cell",
        "rnn_relu_cell",
        "_scaled_dot_product_flash_attention",
        "scaled_dot_product_attention",
    ]
)
FLOAT32 = frozenset(
    [
        "acos",
        "asin",
        "cosh",
        "erfinv",
        "exp",
        "expm1",
        "log",
        "log10",
        "log2",
        "log1p",
        "reciprocal",
        "rsqrt",
        "sinh",
        "tan",
        "pow",
        "softplus",
        "layer_norm",
        "native_layer_norm",
        "group_norm",
        "frobenius_norm",
        "nuclear_norm",
        "cosine_similarity",
        "poisson_nll_loss",
        "cosine_embedding_loss",
        "nll_loss",
        "nll_loss2d",
        "hinge_embedding_loss",
        "kl_div",
        "l1_loss",
        "smooth_l1_loss",
        "huber_loss",
        "mse_loss",
        "margin_ranking_loss",
        "multilabel_margin_loss",
        "soft_margin_loss",
        "triplet_margin_loss",
        "multi_margin_loss",
        "binary_cross_entropy_with_logits",
        "dist",
        "pdist",
        "cdist",
        "renorm",
        "logsumexp",
        "upsample_nearest1d",
        "_upsample_nearest_exact1d",
        "upsample_nearest2d",
        "_upsample_nearest_exact2d",
        "upsample_nearest3d",
        "_upsample_nearest_exact3d",
        "upsample_linear1d",
        "upsample_bilinear2d",
        "_upsample_bilinear2d_aa",
        "upsample_trilinear3d",
        "upsample_bicubic2d",
        "_upsample_bicubic2d_aa",
        "prod",
        "softmax",
        "log_softmax",
        "cumprod",
        "cumsum",
        "linalg_vector_norm",
        "linalg_matrix_norm",
        "sum",
        "norm",
    ]
)
PROMOTE = frozenset(
    [
        "addcdiv",
        "addcmul",
        "atan2",
        "bilinear",
        "cross",
        "dot",
        "grid_sampler",
        "index_put",
        "scatter_add",
        "tensordot",
    ]
)


def _cast(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, torch.Tensor):
        if x.is_floating_point() and x.dtype != dtype and x.device.type == DEVICE_TYPE:
            return x.to(dtype)
        return x
    if isinstance(x, (list, tuple)):
        return type(x)(_cast(v, dtype) for v in x)
    return x


def _widest(args: Any) -> torch.dtype | None:
    widest = None
    for x in args:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            widest = x.dtype if widest is None else torch.promote_types(widest, x.dtype)
    return widest


def policy(op: Any, *args: Any, **kwargs: Any) -> Any:
    """An AutocastPrivateUse1 kernel: cast as CUDA would, then run below autocast."""
    name = op._schema.name.split("::", 1)[-1]
    if name in LOWER_PRECISION:
        dtype = torch.get_autocast_dtype(DEVICE_TYPE)
        args, kwargs = _cast(args, dtype), _cast(kwargs, dtype)
    elif name in FLOAT32:
        args, kwargs = _cast(args, torch.float32), _cast(kwargs, torch.float32)
    elif name in PROMOTE:
        widest = _widest([*args, *kwargs.values()])
        if widest is not None:
            args, kwargs = _cast(args, widest), _cast(kwargs, widest)
    with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(_KEY)):
        return op(*args, **kwargs)


def kernels() -> list[tuple[str, Any]]:
    """(qualified op name, kernel) for every listed overload (registered on the
    AutocastPrivateUse1 key by ``extension_points.py``; every other op falls through)."""
    out = []
    for name in sorted(LOWER_PRECISION | FLOAT32 | PROMOTE):
        packet = getattr(torch.ops.aten, name, None)
        if packet is None:
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            if any(a.is_out for a in op._schema.arguments):
                continue  # CUDA's autocast leaves out= variants alone too
            out.append((name if overload == "default" else f"{name}.{overload}", _kernel(op)))
    return out


def _kernel(op: Any) -> Any:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        return policy(op, *args, **kwargs)

    return kernel
