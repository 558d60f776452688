"""Output metadata of a captured op, inferred on the meta device and cached.

Running an op on meta tensors costs ~100 µs; capture must cost a few. Like FakeTensor's
dispatch cache, the result (output dtypes, shapes, strides, which outputs alias which
inputs) is cached per (op, input metadata, constant arguments), so a model's second
forward pays only for a dictionary lookup per op.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from djinn.errors import ExecutionError, UnsupportedOp
from djinn.protocol import norm_stats

META = torch.device("meta")
CACHE_LIMIT = 1 << 16


@dataclass(frozen=True, slots=True)
class TensorSpec:
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    alias: int | None  # index of the flattened input this output *is* (in-place / out=)
    bits: int = 0  # CONJ | NEG: Note [conjugate and negative views]


# Note [conjugate and negative views]: ``z.conj()`` of a complex tensor is a view with
# PyTorch's conjugate bit set, not a copy, and composite code reads that bit: ``z.imag``
# of a conjugated view takes ``_conj`` back off, then ``view_as_real``, then a negative
# view (``_neg_view``, the negative bit). A remote tensor's wrapper without the bits took
# the other branch, and the appliance, whose tensor had the bit, refused: ``z.conj().imag``
# and ``.real`` raised "view_as_real doesn't work on unresolved conjugated tensors", and
# ``resolve_conj()`` did nothing. So an output's spec carries both bits from its meta
# output, the wrapper is made with them, the meta inputs an op is inferred on have them,
# and they are part of the meta cache's key.
CONJ, NEG = 1, 2


def bits_of(t: torch.Tensor) -> int:
    """``t``'s conjugate and negative bits (Note [conjugate and negative views])."""
    return (CONJ if t.is_conj() else 0) | (NEG if t.is_neg() else 0)


def set_bits(t: torch.Tensor, bits: int) -> torch.Tensor:
    """``t`` with the conjugate and negative bits of ``bits`` set, in place."""
    if bits & CONJ:
        torch._C._set_conj(t, True)
    if bits & NEG:
        torch._C._set_neg(t, True)
    return t


class DataDependent(Exception):
    """The op's output metadata depends on values: it must run remotely to be known."""


_cache: dict[Any, Any] = {}
# An op that returns nothing (an in-place ``_foreach_`` op) has the spec None: a cache
# lookup that used None for "not cached" ran its meta kernel at every capture, over every
# tensor in its lists (an Adam(foreach=True) step: three such ops, ~9 ms each, 2 cores).
_MISSING = object()


# Note [pointwise keys]: the meta cache's key holds the values of an op's scalars and of
# small local tensors, because some ops' output shapes depend on them (view sizes, arange's
# bounds, interpolate's scale factors). A pointwise op's output metadata never does: its
# shape is its tensor operands' broadcast, its dtype follows the scalars' *kinds* (bool,
# integer, floating, complex), not their values. Keyed by value, an optimizer's step,
# whose bias corrections are new Python floats every step, added a cache entry per op
# per step (a 1,000-step Adam loop grew the client by 3.8 MB until the cache's
# wholesale clear at 65,536 entries). For pointwise ops the key holds the kind alone.
SCALAR_KINDS = (bool, int, float, complex)


_values_matter_of: dict[Any, bool] = {}  # per op: capture is a hot path, tags a list


def values_matter(func: Any) -> bool:
    matter = _values_matter_of.get(func)
    if matter is None:
        pointwise = torch.Tag.pointwise in getattr(func, "tags", ())
        matter = not pointwise and not _foreach(func)
        _values_matter_of[func] = matter
    return matter


def _foreach(func: Any) -> bool:
    """A ``_foreach_*`` op: each output is the pointwise op's on the tensors at its
    position, so its metadata is theirs too, whatever the scalars' values (Note [pointwise
    keys]). PyTorch tags the pointwise ops, not their foreach forms: an ``Adam(foreach=
    True)`` step's bias corrections, new Python floats in a ScalarList every step, missed
    the cache each step, and inferring a foreach op over 22 tensors on meta took ms."""
    name = getattr(func, "__name__", "")
    return name.startswith("_foreach_")


def meta_tensor(dtype: torch.dtype, shape, stride, offset: int, bits: int = 0) -> torch.Tensor:
    extent = offset + sum((n - 1) * s for n, s in zip(shape, stride, strict=True) if n) + 1
    if any(n == 0 for n in shape):
        extent = offset
    base = torch.empty(max(extent, 0), dtype=dtype, device=META)
    view = base.as_strided(shape, stride, offset)
    return set_bits(view, bits) if bits else view


def infer(func: Any, key: Any, build_meta_args) -> Any:
    """Cached output spec for ``func``; ``build_meta_args()`` -> (args, kwargs, flat inputs)."""
    spec = _cache.get(key, _MISSING) if key is not None else _MISSING
    if spec is not _MISSING:
        return spec
    margs, mkwargs, flat_inputs = build_meta_args()
    try:
        out = func(*margs, **mkwargs)
    except (NotImplementedError, torch._subclasses.fake_tensor.DynamicOutputShapeException) as exc:
        raise DataDependent(str(exc)) from None
    except ZeroDivisionError as exc:
        # PyTorch's Python meta kernels of some losses' backward (mse, smooth_l1, huber)
        # divide by the input's numel: an empty batch, which the real kernel takes (a nan
        # loss, an empty gradient), raised here (a hunt). Run it remotely, as an op with no
        # meta kernel (appliance/executor/metacheck.py lets these through too).
        given = [t for t in (*margs, *mkwargs.values()) if isinstance(t, torch.Tensor)]
        if any(t.numel() == 0 for t in given):
            raise DataDependent(str(exc)) from None
        # arguments eager's kernel refuses (``pixel_shuffle(x, 0)``), typed as a runtime
        # error as eager's refusal is (a review: a bare ZeroDivisionError)
        raise ExecutionError(f"{func._schema.name}: its arguments divide by zero ({exc})") from None
    except RuntimeError as exc:
        # No meta kernel, or one that needs values (item() inside the op): run it remotely,
        # where a genuine argument error surfaces as EXECUTION_ERROR with PyTorch's text.
        text = str(exc)
        if "meta" in text.lower():
            raise DataDependent(text) from None
        raise
    if func is _CONVOLUTION:
        out = _convolution_layout(margs, out)
    spec = _spec(out, flat_inputs)
    if key is not None:
        if len(_cache) >= CACHE_LIMIT:
            _cache.clear()
        _cache[key] = spec
    return spec


# Note [convolution layouts]: PyTorch's meta kernel for ``convolution`` answers
# contiguous where its CPU kernels answer channels-last: when the input or the weight is
# channels-last, in every dtype, transposed or grouped (36 cases checked, float64 too;
# cuDNN does the same for the dtypes it takes). So a channels-last
# model (``model.to(memory_format=torch.channels_last)``) showed the program contiguous
# outputs, where eager's are channels-last (``view`` then succeeded where eager's fails),
# and the worker copied each output into the layout the client was told (Note [meta
# strides], a copy per convolution). The client now says what the kernels do; where a
# kernel still answers otherwise (another backend), the worker's copy keeps both agreeing.
_CONVOLUTION = torch.ops.aten.convolution.default


def _convolution_layout(margs: Any, out: Any) -> Any:
    from torch._prims_common import suggest_memory_format

    if not isinstance(out, torch.Tensor) or out.dim() not in (4, 5):
        return out
    last = torch.channels_last if out.dim() == 4 else torch.channels_last_3d
    given = [t for t in margs[:2] if isinstance(t, torch.Tensor) and t.dim() == out.dim()]
    if any(suggest_memory_format(t) == last for t in given):
        return torch.empty_like(out, memory_format=last)
    return out


def _spec(out: Any, flat_inputs: list[torch.Tensor]) -> Any:
    if isinstance(out, torch.Tensor):
        if out.layout != torch.strided:
            raise UnsupportedOp(f"{out.layout} tensors cannot live on the appliance yet")
        alias = next((i for i, t in enumerate(flat_inputs) if t is out), None)
        if out.device.type != "meta":
            raise UnsupportedOp(f"op produced a {out.device.type} tensor from meta inputs")
        return TensorSpec(
            out.dtype,
            tuple(out.shape),
            tuple(out.stride()),
            out.storage_offset(),
            alias,
            bits_of(out),
        )
    if isinstance(out, (tuple, list)):
        return (
            type(out)(_spec(o, flat_inputs) for o in out)
            if type(out) in (tuple, list)
            else tuple(_spec(o, flat_inputs) for o in out)
        )
    return out


def clear_cache() -> None:
    _cache.clear()


def cache_size() -> int:
    return len(_cache)


def spec_of(t: torch.Tensor) -> TensorSpec:
    return TensorSpec(
        t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset(), None, bits_of(t)
    )


def spec_tuple(t: torch.Tensor) -> tuple:
    """What ``meta_tensor`` takes to make ``t``'s meta twin."""
    return t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset(), bits_of(t)


def cpu_statistics(func: Any, spec: Any, args: tuple, kwargs: dict) -> Any:
    """Note [statistics dtypes] (djinn/protocol/norm_stats.py): on a CPU worker, the saved
    statistics of a half-precision normalization take the CPU kernel's dtype."""
    from .session import current_device_type

    dtype = norm_stats.cpu_dtype(func, args, kwargs)
    if dtype is None or current_device_type(start=True) != "cpu":
        return spec
    out = list(spec)
    for i in norm_stats.STATISTICS:
        s = out[i]
        out[i] = TensorSpec(dtype, s.shape, s.stride, s.offset, s.alias, s.bits)
    return type(spec)(out)


_HOST_ARGS: dict[Any, tuple[int, ...]] = {}


def host_args(func: Any) -> tuple[int, ...]:
    """Positions of arguments the kernel wants as CPU tensors whatever the device (the
    per-list ``scalars`` of the ``_foreach_*.Tensor`` overloads, as on CUDA)."""
    known = _HOST_ARGS.get(func)
    if known is None:
        schema = getattr(func, "_schema", None)
        known = tuple(
            i
            for i, a in enumerate(schema.arguments if schema is not None else ())
            if a.name == "scalars" and str(a.type) == "Tensor"
        )
        _HOST_ARGS[func] = known
    return known
