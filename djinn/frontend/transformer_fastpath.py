"""``nn.TransformerEncoder`` and ``nn.MultiheadAttention`` in evaluation on the remote device:
PyTorch's fused "fast path", op for op.

Note [transformer fast path]: in eval mode with gradients off (a validation loop),
``TransformerEncoderLayer`` and ``MultiheadAttention`` call one fused op each,
``aten::_transformer_encoder_layer_fwd`` and ``aten::_native_multi_head_attention``, and
PyTorch lets the remote device take that path (it names the PrivateUse1 device among the
supported ones). The appliance does not run those ops, so every validation loop over an
``nn.TransformerEncoder`` failed with UNSUPPORTED_OP, while training passed.

Their CPU bodies (``aten/src/ATen/native/transformers/transformer.cpp`` and
``attention.cpp``) are compositions of ordinary ops, written here in the same order:
- the encoder layer: attention, ``add_`` of the input, ``layer_norm``, the feed-forward
  pair (``addmm`` and its activation, then ``addmm``), ``add_``, ``layer_norm``;
- attention: the projection by ``matmul``, the bias and the query's scaling
  (``_transform_bias_rescale_qkv``, a CPU kernel the appliance does not run, as
  element-wise ops: the same IEEE operations), ``bmm``, the softmax, ``bmm``, the
  output projection. (CUDA's body first tries ``scaled_dot_product_attention`` when there
  is no mask and no weights are asked for; the CPU's does not: on a CPU this order is
  local eager's to the bit, for every shape tried.)

Unmasked, the results are local eager's to the bit. Masked, the softmax is
``masked_fill`` with -inf then ``softmax`` (a row with every position masked gives NaN,
as ``_masked_softmax`` does): within a few ulps of eager's kernel, whose summation differs.

With ``src_key_padding_mask``, ``nn.TransformerEncoder`` (``enable_nested_tensor=True``, the
default; ``nn.Transformer``'s encoder too) packs the batch into nested tensors, which the
remote device does not have: it fails with a typed error that names the way out
(``enable_nested_tensor=False``, or ``model.encoder.use_nested_tensor = False``), under which
local eager computes what the remote device does. (The nested path leaves zeros at the
padded positions, the other path the layers' values there: an ``nn.Transformer``'s decoder
attends to them, so its output differs between the two, locally as well.)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from djinn.errors import UnsupportedOp

from . import lazy

Tensor = torch.Tensor
_aten = torch.ops.aten


@functools.cache
def _inv_sqrt(dim_per_head: int, dtype: torch.dtype) -> float:
    """``1.0 / std::sqrt(static_cast<scalar_t>(dim_per_head))`` stored as ``scalar_t``, as
    the CPU kernel computes it: the root in float32 (in float64 for double), a double
    division, then rounded to the tensor's dtype."""
    root = math.sqrt(dim_per_head)
    if dtype != torch.float64:
        root = float(np.float32(root))
    return torch.tensor(1.0 / root, dtype=dtype, device="cpu").item()


def _project(query: Tensor, key: Tensor, value: Tensor, embed_dim: int, w: Tensor) -> Tensor:
    """``qkv_projection``: [B, T, 3D], by ``matmul`` with the weight's transpose."""
    if key is value:
        if query is key:
            return torch.matmul(query, w.t())
        w_q, w_kv = w.split_with_sizes([embed_dim, embed_dim * 2])
        return torch.cat([torch.matmul(query, w_q.t()), torch.matmul(key, w_kv.t())], 2)
    w_q, w_k, w_v = w.chunk(3)
    parts = [torch.matmul(x, part.t()) for x, part in ((query, w_q), (key, w_k), (value, w_v))]
    return torch.cat(parts, 2)


def _bias_rescale(qkv: Tensor, bias: Tensor, heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """``_transform_bias_rescale_qkv``: q = (q + b_q) * 1/sqrt(d), k + b_k, v + b_v, each
    [B, heads, T, d]."""
    b, t, three_d = qkv.shape
    d = three_d // 3 // heads
    parts = (qkv.view(b, t, 3, heads, d) + bias.view(3, heads, d)).permute(2, 0, 3, 1, 4)
    q = parts[0].mul(_inv_sqrt(d, qkv.dtype)).contiguous()
    return q, parts[1].contiguous(), parts[2].contiguous()


def _masked_softmax(scores: Tensor, mask: Tensor | None, mask_type: int | None) -> Tensor:
    """``masked_softmax`` of attention.cpp over the last dim of [B, H, T, S] scores; a True
    mask entry is a position not attended (mask_type 0: [T, S]; 1: [B, S] key padding;
    2: already the scores' shape)."""
    if mask is None:
        return torch._softmax(scores, -1, False)
    mask = mask if mask.dtype == torch.bool else mask.to(torch.bool)
    b, h, t, s = scores.shape
    if mask_type == 1 or (mask_type is None and mask.dim() == 2 and mask.shape == (b, s)):
        mask = mask.view(b, 1, 1, s)
    elif mask.dim() == 2:
        mask = mask.view(1, 1, t, s)
    # a row with every position masked gives NaN, as eager's kernel does (torch 2.13)
    return torch._softmax(scores.masked_fill(mask.expand(b, h, t, s), float("-inf")), -1, False)


def native_multi_head_attention(
    query: Tensor, key: Tensor, value: Tensor, embed_dim: int, num_head: int,
    qkv_weight: Tensor, qkv_bias: Tensor, proj_weight: Tensor, proj_bias: Tensor,
    mask: Tensor | None = None, need_weights: bool = True, average_attn_weights: bool = True,
    mask_type: int | None = None,
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
        raise RuntimeError("expected 3-D `query`, `key` and `value`")
    if query.shape[2] != embed_dim or not query.shape == key.shape == value.shape:
        raise RuntimeError("expected `query`/`key`/`value` shapes to match")
    if tuple(qkv_weight.shape) != (3 * embed_dim, embed_dim) or qkv_bias.shape != (3 * embed_dim,):
        raise RuntimeError("expected `qkv_weight` of [3 x embed_dim, embed_dim]")
    if num_head <= 0 or embed_dim % num_head:
        raise RuntimeError("`embed_dim` must divide evenly by `num_heads`")
    d = embed_dim // num_head
    b = query.shape[0]
    qkv = _project(query, key, value, embed_dim, qkv_weight)
    if qkv.numel() == 0:
        return torch.empty_like(query), None
    q, k, v = _bias_rescale(qkv, qkv_bias, num_head)
    t = q.shape[2]
    scores = torch.bmm(q.view(b * num_head, t, d), k.view(b * num_head, t, d).transpose(2, 1))
    weights = _masked_softmax(scores.view(b, num_head, t, t), mask, mask_type)
    ctx = torch.bmm(weights.view(b * num_head, t, t), v.view(b * num_head, t, d))
    ctx = ctx.view(b, num_head, t, d).permute(0, 2, 1, 3).contiguous().view(b * t, embed_dim)
    proj = F.linear(ctx, proj_weight, proj_bias).view(b, t, -1)
    if not need_weights:
        return proj, None
    if average_attn_weights:
        weights = weights.sum(1).div_(num_head)
    return proj, weights


def transformer_encoder_layer_fwd(
    src: Tensor, embed_dim: int, num_heads: int, qkv_weight: Tensor, qkv_bias: Tensor,
    proj_weight: Tensor, proj_bias: Tensor, use_gelu: bool, norm_first: bool, eps: float,
    norm_weight_1: Tensor, norm_bias_1: Tensor, norm_weight_2: Tensor, norm_bias_2: Tensor,
    ffn_weight_1: Tensor, ffn_bias_1: Tensor, ffn_weight_2: Tensor, ffn_bias_2: Tensor,
    mask: Tensor | None = None, mask_type: int | None = None,
) -> Tensor:  # fmt: skip
    if src.numel() == 0:
        return src.clone()

    def norm(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
        return F.layer_norm(x, (embed_dim,), weight, bias, eps)

    x = norm(src, norm_weight_1, norm_bias_1) if norm_first else src
    x = native_multi_head_attention(
        x, x, x, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias,
        mask, False, True, mask_type,
    )[0]  # fmt: skip
    x.add_(src)
    if not norm_first:
        x = norm(x, norm_weight_1, norm_bias_1)
    residual = x
    if norm_first:
        x = norm(x, norm_weight_2, norm_bias_2)
    b, t = x.shape[0], x.shape[1]
    # ffn: addmm then its activation in place (the CPU's _addmm_activation), then addmm
    h = torch.addmm(ffn_bias_1, x.view(b * t, x.shape[2]), ffn_weight_1.t())
    h = F.gelu(h) if use_gelu else h.relu_()
    x = torch.addmm(ffn_bias_2, h, ffn_weight_2.t()).view(b, t, -1)
    x.add_(residual)
    if not norm_first:
        x = norm(x, norm_weight_2, norm_bias_2)
    return x


def nested_from_mask_left_aligned(t: Tensor, mask: Tensor) -> bool:
    raise UnsupportedOp(
        "nn.TransformerEncoder with src_key_padding_mask in eval mode packs the batch into "
        "nested tensors, which the remote device does not have: build it with "
        "enable_nested_tensor=False, or set encoder.use_nested_tensor = False (for "
        "nn.Transformer: model.encoder.use_nested_tensor = False); local eager then computes "
        "what the remote device does (the padded positions hold the layers' values, not zeros)"
    )


KERNELS: dict[str, Callable] = {
    "_native_multi_head_attention": native_multi_head_attention,
    "_transformer_encoder_layer_fwd": transformer_encoder_layer_fwd,
    "_nested_tensor_from_mask_left_aligned": nested_from_mask_left_aligned,
}


lazy.take_as_special(KERNELS)  # under inference_mode, which skips autograd's key
