"""Checks for allowed ops whose kernels trust an argument their meta kernel does not check.

Schema checks (``opargs``) and the meta run (``metacheck``) catch most bad arguments.
A few CPU kernels still index memory by a size they never compare with the tensor they
index: batch norm reads ``running_mean[c]`` for every channel ``c`` of the input,
whatever ``running_mean``'s length; ``_fft_c2r``'s ``normalization`` is cast to an enum
unchecked; reflection padding's backward writes at offsets computed from a padding it
trusts to be non-negative, with a gradient whose shape it never compares; max pooling's
backward adds at the positions its ``indices`` name. Each such op
gets its missing check here, keyed by op name (every overload), found by the op fuzz
and the issue's repros.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from djinn.errors import ExecutionError, InvalidArgument
from djinn.protocol import flash_attention

Check = Callable[[str, dict[str, Any]], None]


def _per_channel(op: str, a: dict[str, Any]) -> None:
    x = a.get("input", a.get("self"))
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        raise InvalidArgument(f"{op}: input must be a tensor of at least 2 dimensions")
    channels = x.shape[1]
    train = a.get("train", a.get("training", a.get("update")))
    if train is False and not all(
        isinstance(a.get(n), torch.Tensor) for n in ("running_mean", "running_var")
    ):
        # evaluation reads the running statistics through their data pointers
        raise InvalidArgument(f"{op}: running_mean and running_var are needed in evaluation")
    for name in (
        "weight", "bias", "running_mean", "running_var", "save_mean", "save_invstd", "save_var",
    ):  # fmt: skip
        t = a.get(name)
        empty = isinstance(t, torch.Tensor) and t.numel() == 0
        if train is False and name.startswith("save_") and empty:
            continue  # autograd's empty statistics of an evaluation: never read
        if isinstance(t, torch.Tensor) and (t.dim() != 1 or t.numel() != channels):
            raise InvalidArgument(
                f"{op}: {name} must be 1-D with one value per channel ({channels}), "
                f"got shape {list(t.shape)}"
            )
    grad = a.get("grad_out")
    if isinstance(grad, torch.Tensor) and grad.shape != x.shape:
        raise InvalidArgument(f"{op}: grad_out must have the input's shape")


def _fft(op: str, a: dict[str, Any]) -> None:
    if a.get("normalization") not in (0, 1, 2):
        raise InvalidArgument(f"{op}: normalization must be 0, 1 or 2")
    x, dims = a.get("self"), a.get("dim")
    if isinstance(x, torch.Tensor) and isinstance(dims, list):
        wrapped = [d % x.dim() if x.dim() and -x.dim() <= d < x.dim() else None for d in dims]
        if None in wrapped or len(set(wrapped)) != len(wrapped):
            raise InvalidArgument(f"{op}: dim must name distinct dimensions of the input")
    if "last_dim_size" in a and not 1 <= a["last_dim_size"] <= (1 << 31):
        raise InvalidArgument(f"{op}: last_dim_size must be positive")


def _padding(op: str, a: dict[str, Any]) -> None:
    x, pad = a.get("self"), a.get("padding")
    if not isinstance(pad, list) or any(type(p) is not int for p in pad):
        raise InvalidArgument(f"{op}: padding must be a list of ints")
    # a negative pad crops, as the kernel does (checked: every output index it reads is
    # in the input; an output of no width it refuses itself)
    if "reflection" in op and isinstance(x, torch.Tensor):
        for k, p in enumerate(pad):
            d = x.dim() - 1 - k // 2
            if d < 0 or p >= x.shape[d]:
                raise InvalidArgument(f"{op}: reflection padding must be smaller than the input")
    grad = a.get("grad_output")
    if isinstance(grad, torch.Tensor) and isinstance(x, torch.Tensor):
        want = list(x.shape)
        for k in range(0, len(pad) - 1, 2):
            d = x.dim() - 1 - k // 2
            if d >= 0:
                want[d] += pad[k] + pad[k + 1]
        if list(grad.shape) != want:
            raise InvalidArgument(f"{op}: grad_output must have the padded input's shape {want}")


def _ctc(op: str, a: dict[str, Any]) -> None:
    """The CTC kernels index ``log_probs`` by the targets' values, and the backward reads
    ``log_alpha`` and ``neg_log_likelihood`` by the forward's shapes, and reads one input
    and one target length per batch element, all unchecked: a target past the classes was
    a SIGSEGV, a short ``log_alpha`` a heap corruption, one length for a batch of three (a
    review: 0-d lengths, an unbatched loss's) a lost worker."""
    lp, targets = a.get("log_probs"), a.get("targets")
    if not isinstance(lp, torch.Tensor) or not isinstance(targets, torch.Tensor):
        return
    if lp.dim() != 3:
        raise InvalidArgument(f"{op}: log_probs must be (time, batch, classes)")
    if targets.dtype not in (torch.int32, torch.int64):
        raise InvalidArgument(f"{op}: targets must be int32 or int64")
    classes = lp.shape[2]
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= classes):
        raise InvalidArgument(f"{op}: a target is out of bounds for {classes} classes")
    # the backward indexes log_probs by blank, and reads any targets that are not 1-d by
    # their first two strides, unchecked (a review: both lost the worker)
    blank = a.get("blank", 0)
    if type(blank) is not int or not 0 <= blank < classes:
        raise InvalidArgument(f"{op}: blank must be a class, below {classes}")
    if targets.dim() not in (1, 2):
        raise InvalidArgument(f"{op}: targets must be 1-d (concatenated) or 2-d (padded)")
    time, batch = lp.shape[0], lp.shape[1]
    lengths = {}
    for name in ("input_lengths", "target_lengths"):
        given = a.get(name)
        if isinstance(given, torch.Tensor):
            given = given.reshape(-1).tolist()
        given = [given] if isinstance(given, int) else list(given or [])
        if len(given) != batch or any(type(n) is not int or n < 0 for n in given):
            raise InvalidArgument(f"{op}: {name} must hold one length per batch element")
        lengths[name] = given
    if any(n > time for n in lengths["input_lengths"]):
        raise InvalidArgument(f"{op}: an input length is longer than log_probs' {time} steps")
    # targets padded (batch, longest) or concatenated: the lengths must fit in them
    tl = lengths["target_lengths"]
    if targets.dim() == 2:
        fits = targets.shape[0] == batch and max(tl, default=0) <= targets.shape[1]
    else:
        fits = sum(tl) <= targets.numel()
    if not fits:
        raise InvalidArgument(f"{op}: target_lengths must fit in the targets")
    if "log_alpha" not in a:
        return
    longest = max(tl, default=0)
    want = {
        "log_alpha": (batch, time, 2 * longest + 1),
        "neg_log_likelihood": (batch,),
        "grad": (batch,),
    }
    for name, shape in want.items():
        t = a.get(name)
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
            raise InvalidArgument(f"{op}: {name} must have the forward's shape {list(shape)}")


def _segments(op: str, a: dict[str, Any]) -> None:
    """``segment_reduce`` reads the data between offsets it does not check (only lengths
    are checked, and nothing with ``unsafe``): offsets past the data read other memory."""
    data = a.get("data")
    if a.get("unsafe"):
        raise InvalidArgument(f"{op}: unsafe=True skips the kernel's checks")
    offsets = a.get("offsets")
    if not isinstance(data, torch.Tensor) or not isinstance(offsets, torch.Tensor):
        return
    axis = a.get("axis", 0)
    if not -data.dim() <= axis < max(data.dim(), 1) or offsets.numel() == 0:
        raise InvalidArgument(f"{op}: axis or offsets out of range")
    if offsets.dtype not in (torch.int32, torch.int64) or offsets.dim() < 1:
        raise InvalidArgument(f"{op}: offsets must be an integer tensor")
    size = data.shape[axis]
    steps = offsets.diff(dim=-1) if offsets.shape[-1] > 1 else offsets.new_zeros(0)
    falling = steps.numel() and int(steps.min()) < 0
    if int(offsets.min()) < 0 or int(offsets.max()) > size or falling:
        raise InvalidArgument(f"{op}: offsets must rise within the data's {size} rows")


MAX_DECIMALS = 1000


def _decimals(op: str, a: dict[str, Any]) -> None:
    """``round(x, decimals=d)``'s meta kernel computes ``10 ** d`` for an integer input as a
    Python integer: ``d = 2**31 - 1`` held the worker's thread for minutes (found by the
    op fuzz). Past a few hundred decimals a float rounds to itself, inf or nan anyway."""
    d = a.get("decimals", 0)
    if type(d) is int and not -MAX_DECIMALS <= d <= MAX_DECIMALS:
        raise InvalidArgument(f"{op}: decimals must lie within ±{MAX_DECIMALS}")


def _pdist(op: str, a: dict[str, Any]) -> None:
    x = a.get("self")
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise InvalidArgument(f"{op}: input must be a 2-D tensor")
    p = a.get("p", 2)
    if not (isinstance(p, (int, float)) and 0 <= p < float("inf")):
        raise InvalidArgument(f"{op}: p must be a non-negative finite number")
    # the backward reads one gradient and one distance per pair of rows, by pointer
    pairs = x.shape[0] * (x.shape[0] - 1) // 2
    for name in ("grad", "pdist"):
        t = a.get(name)
        if name in a and not (isinstance(t, torch.Tensor) and tuple(t.shape) == (pairs,)):
            raise InvalidArgument(f"{op}: {name} must hold one value per pair of rows")


def _cdist_backward(op: str, a: dict[str, Any]) -> None:
    """``_cdist_backward`` reads ``grad`` and ``cdist`` by pointer, one value per pair of
    rows of ``x1`` and ``x2``, after broadcasting their batch dims: a one-value ``grad``
    was read past (local PyTorch accepts it). Both must have exactly the distances'
    shape, ``x1`` and ``x2`` the same row length, and ``p`` be non-negative, as the
    forward requires."""
    x1, x2 = a.get("x1"), a.get("x2")
    if not (isinstance(x1, torch.Tensor) and isinstance(x2, torch.Tensor)):
        raise InvalidArgument(f"{op}: x1 and x2 must be tensors")
    if x1.dim() < 2 or x2.dim() < 2 or x1.shape[-1] != x2.shape[-1]:
        raise InvalidArgument(f"{op}: x1 and x2 must be [..., rows, m] with the same m")
    try:
        batch = torch.broadcast_shapes(x1.shape[:-2], x2.shape[:-2])
    except RuntimeError:
        raise InvalidArgument(f"{op}: x1's and x2's batch dims do not broadcast") from None
    shape = (*batch, x1.shape[-2], x2.shape[-2])
    for name in ("grad", "cdist"):
        t = a.get(name)
        if not (isinstance(t, torch.Tensor) and tuple(t.shape) == shape):
            raise InvalidArgument(f"{op}: {name} must have the distances' shape {list(shape)}")
    p = a.get("p")
    if not (isinstance(p, (int, float)) and p >= 0):
        raise InvalidArgument(f"{op}: p must be non-negative")


def _weight_norm(op: str, a: dict[str, Any]) -> None:
    """``_weight_norm_interface`` reads one ``g`` (and, backward, one saved norm) per slice
    of ``v`` along ``dim``, by pointer: a ``g`` of one value for four rows returned three
    values read past it (local PyTorch runs it). Each must hold ``v.size(dim)`` values, and
    the backward's gradient ``v``'s shape."""
    v = a.get("v", a.get("saved_v"))
    dim = a.get("dim", 0)  # the schema's default, which the client leaves out
    if not isinstance(v, torch.Tensor) or not v.dim() or not isinstance(dim, int):
        raise InvalidArgument(f"{op}: v must be a tensor of at least one dimension")
    if dim not in (0, v.dim() - 1):
        raise InvalidArgument(f"{op}: dim must be 0 or v's last dimension")
    slices = v.shape[dim]
    for name in ("g", "saved_g", "saved_norms"):
        t = a.get(name)
        if name in a and not (isinstance(t, torch.Tensor) and t.numel() == slices):
            raise InvalidArgument(f"{op}: {name} must hold one value per slice of v along dim")
    grad = a.get("grad_w")
    if "grad_w" in a and not (isinstance(grad, torch.Tensor) and grad.shape == v.shape):
        raise InvalidArgument(f"{op}: grad_w must have v's shape")


def _class_targets(op: str, a: dict[str, Any]) -> None:
    """Without reduction, nll_loss's backward writes ``grad_input[i][target[i]]`` (and
    reads ``weight[target[i]]``) with no bounds check: a target past the classes was a
    write outside the gradient (SIGSEGV). Every target but ``ignore_index`` must name a
    class, as the forward kernels check."""
    x, target = a.get("self"), a.get("target")
    if not isinstance(x, torch.Tensor) or not isinstance(target, torch.Tensor) or x.dim() < 1:
        return  # the schema checks and the meta kernel refuse these
    if target.dtype not in (torch.int64, torch.uint8):
        raise InvalidArgument(f"{op}: target must be int64 (or uint8)")
    classes = x.shape[1] if "2d" in op or x.dim() > 2 else x.shape[-1]
    named = target[target != a.get("ignore_index", -100)]
    if named.numel() and (int(named.min()) < 0 or int(named.max()) >= classes):
        raise InvalidArgument(f"{op}: a target is out of bounds for {classes} classes")


def _repeats(op: str, a: dict[str, Any]) -> None:
    """``repeat_interleave``'s CPU kernel writes index ``i`` over ``cumsum(repeats)[i] -
    repeats[i]`` up to ``cumsum(repeats)[i]`` of an output of ``output_size`` elements
    when given, checking neither: an ``output_size`` below the sum was a write past the
    output, one above it left worker memory unwritten in the result, and repeats whose
    running sum wraps int64 wrote anywhere. So no repeat is negative, and an
    ``output_size`` is the sum, computed where it cannot wrap (Note [sizes by value]
    bounds the sum itself), and so is an ``out=`` tensor's size: the kernel resizes it,
    and with no meta kernel nothing charges the growth."""
    repeats, size = a.get("repeats"), a.get("output_size")
    if not isinstance(repeats, torch.Tensor) or repeats.dim() != 1 or not repeats.numel():
        return  # an int's repeats (self_int) need no check; the kernel refuses the rest
    if repeats.is_floating_point() or repeats.is_complex() or repeats.dtype == torch.bool:
        return
    low, top = (int(v) for v in torch.aminmax(repeats))
    if low < 0:
        raise ExecutionError(f"{op}: repeats can not be negative")
    out = a.get("out")
    if size is None and out is None:
        return
    if top * repeats.numel() >= 1 << 62:  # a sum that could wrap: no memory holds it
        raise InvalidArgument(f"{op}: the repeats add up past 2**62")
    total = int(repeats.sum())
    if size is not None and size != total:
        raise InvalidArgument(f"{op}: output_size {size} is not the sum of repeats, {total}")
    # an out= tensor the kernel would resize: grown where no meta run could charge it
    if out is not None and (not isinstance(out, torch.Tensor) or out.numel() != total):
        raise InvalidArgument(f"{op}: out must have the sum of repeats' elements, {total}")


def _flash_cpu(op: str, a: dict[str, Any]) -> None:
    """The CPU flash-attention kernel checks none of the shapes it indexes by: the rule
    the frontend captures it by (djinn/protocol/flash_attention.py)."""
    q, k, v = a.get("query"), a.get("key"), a.get("value")
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        raise InvalidArgument(f"{op}: query, key and value must be tensors")
    reason = flash_attention.refusal(q, k, v)
    if reason is not None:
        raise InvalidArgument(f"{op}: {reason}")
    mask = a.get("attn_mask")
    if mask is not None:
        reason = (
            flash_attention.mask_refusal(mask, q, k)
            if isinstance(mask, torch.Tensor)
            else "attn_mask must be a tensor"
        )
        if reason is not None:
            raise InvalidArgument(f"{op}: {reason}")
    if a.get("dropout_p", 0.0) != 0.0:
        raise InvalidArgument(f"{op}: dropout_p must be 0")


def _flash_cpu_backward(op: str, a: dict[str, Any]) -> None:
    """Its backward (allowed as the ``_backward`` of an allowed op) reads ``out`` and
    ``grad_out`` at the query's indices, ``out`` with a unit last stride, and the
    ``logsumexp`` at (batch, head, query row) as the accumulation dtype: it checks only
    the head sizes."""
    _flash_cpu(op, a)
    q = a["query"]
    out, grad, lse = a.get("out"), a.get("grad_out"), a.get("logsumexp")
    if not all(isinstance(t, torch.Tensor) for t in (out, grad, lse)):
        raise InvalidArgument(f"{op}: grad_out, out and logsumexp must be tensors")
    if out.shape != q.shape or grad.shape != q.shape:
        raise InvalidArgument(
            f"{op}: out and grad_out must have the query's shape {list(q.shape)} "
            f"(out {list(out.shape)}, grad_out {list(grad.shape)})"
        )
    if out.dtype != q.dtype or grad.dtype != q.dtype or out.stride(3) != 1:
        raise InvalidArgument(
            f"{op}: out and grad_out must be the query's dtype, out unit-strided last"
        )
    accumulate = torch.float64 if q.dtype == torch.float64 else torch.float32
    if lse.shape != q.shape[:3] or lse.dtype != accumulate:
        raise InvalidArgument(
            f"{op}: logsumexp must be {accumulate} of shape {list(q.shape[:3])} "
            f"(got {lse.dtype} {list(lse.shape)})"
        )


def _spatial(op: str) -> int:
    return 3 if "3d" in op else 2


def _pooled_grad(op: str, a: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A pooling backward's input and gradient, of one dtype and rank, the same batch and
    channels: the kernels index both by the input's sizes and read the gradient as the
    input's dtype, checking neither."""
    x, grad, k = a.get("self"), a.get("grad_output"), _spatial(op)
    if not (isinstance(x, torch.Tensor) and isinstance(grad, torch.Tensor)):
        raise InvalidArgument(f"{op}: self and grad_output must be tensors")
    if x.dim() not in (k + 1, k + 2) or grad.dim() != x.dim() or grad.dtype != x.dtype:
        raise InvalidArgument(
            f"{op}: self and grad_output must be {k + 1}-D or {k + 2}-D tensors of one dtype"
        )
    if grad.shape[:-k] != x.shape[:-k] or 0 in x.shape[-k:]:
        raise InvalidArgument(
            f"{op}: grad_output must have the input's batch and channels, over a non-empty "
            f"input (self {list(x.shape)}, grad_output {list(grad.shape)})"
        )
    return x, grad, k


def _adaptive_avg_backward(op: str, a: dict[str, Any]) -> None:
    _pooled_grad(op, a)


def _pool_indices(op: str, a: dict[str, Any]) -> None:
    """A max pooling's backward adds each gradient at the flat input position its
    ``indices`` name, unchecked: a hostile index wrote outside the allocation (the worker
    died of SIGSEGV). The positions are checked here, which reads the indices once."""
    x, grad, k = _pooled_grad(op, a)
    idx = a.get("indices")
    if not isinstance(idx, torch.Tensor) or idx.dtype != torch.int64 or idx.shape != grad.shape:
        raise InvalidArgument(f"{op}: indices must be int64 of grad_output's shape")
    span = 1
    for n in x.shape[-k:]:
        span *= n
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= span):
        raise InvalidArgument(f"{op}: indices must name positions of the input (0 to {span - 1})")


def _rrelu_noise(op: str, a: dict[str, Any]) -> None:
    """rrelu's kernels write (and its backward reads) one noise value per element of the
    input at ``noise``'s data pointer, as if it were contiguous: a stride-0 noise of the
    right shape wrote past its storage (the worker died of SIGSEGV; found by review)."""
    x, noise = a.get("self"), a.get("noise")
    if not (isinstance(x, torch.Tensor) and isinstance(noise, torch.Tensor)):
        raise InvalidArgument(f"{op}: self and noise must be tensors")
    if noise.shape != x.shape or noise.dtype != x.dtype or not noise.is_contiguous():
        raise InvalidArgument(f"{op}: noise must be a contiguous tensor of the input's shape")


CHECKS: dict[str, Check] = {
    **{f"aten::rrelu_with_noise{s}": _rrelu_noise for s in ("", "_", "_backward")},
    **{f"aten::_adaptive_avg_pool{n}d_backward": _adaptive_avg_backward for n in (2, 3)},
    **{
        f"aten::{name}": _pool_indices
        for name in (
            "max_pool2d_with_indices_backward",
            "max_pool3d_with_indices_backward",
            "adaptive_max_pool2d_backward",
            "adaptive_max_pool3d_backward",
            "fractional_max_pool2d_backward",
            "fractional_max_pool3d_backward",
        )
    },
    "aten::_scaled_dot_product_flash_attention_for_cpu": _flash_cpu,
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": _flash_cpu_backward,
    "aten::round": _decimals,
    "aten::_ctc_loss": _ctc,
    "aten::_ctc_loss_backward": _ctc,
    "aten::segment_reduce": _segments,
    "aten::repeat_interleave": _repeats,
    "aten::nll_loss_forward": _class_targets,
    "aten::nll_loss_backward": _class_targets,
    "aten::nll_loss2d_forward": _class_targets,
    "aten::nll_loss2d_backward": _class_targets,
    "aten::_cdist_backward": _cdist_backward,
    "aten::_weight_norm_interface": _weight_norm,
    "aten::_weight_norm_interface_backward": _weight_norm,
    "aten::_pdist_forward": _pdist,
    "aten::_pdist_backward": _pdist,
    "aten::_native_batch_norm_legit": _per_channel,
    "aten::_native_batch_norm_legit_no_training": _per_channel,
    "aten::native_batch_norm": _per_channel,
    "aten::_batch_norm_with_update": _per_channel,
    "aten::native_batch_norm_backward": _per_channel,
    "aten::batch_norm_backward": _per_channel,
    "aten::_fft_c2r": _fft,
    "aten::_fft_r2c": _fft,
    "aten::_fft_c2c": _fft,
    **{
        f"aten::{kind}_pad{n}d{suffix}": _padding
        for kind in ("reflection", "replication")
        for n in (1, 2, 3)
        for suffix in ("", "_backward")
    },
}


def _foreach_lengths(op: str, a: dict[str, Any]) -> None:
    """The ``_foreach_*`` kernels walk their lists in step, by the first one's length, and
    most check the others against it; ``_foreach_copy`` (the functional form) does not:
    ``_foreach_copy([], [t])`` is a SIGSEGV in local PyTorch too (found by the op fuzz).
    Every list argument must be as long as the first."""
    lengths = {name: len(v) for name, v in a.items() if isinstance(v, (list, tuple))}
    if len(set(lengths.values())) > 1:
        detail = ", ".join(f"{name} {n}" for name, n in lengths.items())
        raise InvalidArgument(f"{op}: its lists must be equally long ({detail})")


def by_op(table: dict[str, Any], op: Any) -> Any:
    """``table``'s entry for ``op`` by its name; an in-place form (``op_``) runs its op's
    kernel, so it takes its op's entry when it has none of its own."""
    name = op._schema.name
    found = table.get(name)
    if found is None and name.endswith("_"):
        found = table.get(name[:-1])
    return found


def _check_of(op: Any) -> Check | None:
    fn = by_op(CHECKS, op)
    if fn is None and op._schema.name.startswith("aten::_foreach_"):
        fn = _foreach_lengths
    return fn


def has_check(op: Any) -> bool:
    """Whether ``op`` has an extra check: an execution plan runs those again on every run,
    since several read the arguments' values (Note [graph plans])."""
    return _check_of(op) is not None


def check(op: Any, named: dict[str, Any]) -> None:
    """Run the extra check for ``op`` (if it has one) on its arguments by name."""
    fn = _check_of(op)
    if fn is not None:
        fn(f"{op._schema.name}.{op._schema.overload_name or 'default'}", named)
