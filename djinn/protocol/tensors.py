"""Tensor descriptors: how a tensor's bytes are described on the wire.

A descriptor is a JSON object ``{"dtype", "shape", "strides"}``; the bytes themselves
travel as a payload segment or sit in a host-arena slab. Strides are kept for any dense,
non-overlapping layout (contiguous, transposed, channels-last...), so a tensor comes back
with the layout it went in with; anything else (a strided slice, an expanded view) is
made contiguous first. ``validate`` proves the strides address exactly ``nbytes`` bytes,
so a hostile descriptor can never make ``as_strided`` read outside its buffer.
"""

from __future__ import annotations

from typing import Any

import torch

from djinn.errors import InvalidArgument

MAX_DIMS = 64

DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint16": torch.uint16,
    "uint32": torch.uint32,
    "uint64": torch.uint64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise InvalidArgument(f"dtype {dtype} cannot be sent to the appliance") from None


def describe(t: torch.Tensor) -> dict[str, Any]:
    """A tensor's metadata as the wire shows it (for handles: no bytes attached)."""
    return {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "strides": list(t.stride())}


def parse_dtype(name: Any) -> torch.dtype:
    dtype = DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise InvalidArgument(f"unknown dtype {name!r}")
    return dtype


def _dense_order(shape: list[int], strides: list[int]) -> list[int] | None:
    """Dim order (outermost first) if shape/strides are dense and non-overlapping."""
    order = sorted(range(len(shape)), key=lambda d: (-strides[d], -shape[d]))
    expected = 1
    for d in reversed(order):
        if shape[d] != 1 and strides[d] != expected:
            return None
        expected *= shape[d]
    return order


def is_dense(shape: list[int], strides: list[int]) -> bool:
    """Whether a layout is dense and non-overlapping: it goes over the wire as it is."""
    return _dense_order(shape, strides) is not None


def validate(desc: Any) -> tuple[torch.dtype, list[int], list[int], int]:
    """Check a descriptor from the wire; return (dtype, shape, strides, nbytes)."""
    if not isinstance(desc, dict):
        raise InvalidArgument("tensor descriptor must be an object")
    dtype = parse_dtype(desc.get("dtype"))
    shape, strides = desc.get("shape"), desc.get("strides")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS:
        raise InvalidArgument(f"shape must be a list of at most {MAX_DIMS} sizes")
    if strides is None:
        strides = contiguous_strides(shape) if _all_sizes(shape) else None
    if not isinstance(strides, list) or len(strides) != len(shape):
        raise InvalidArgument("strides must be a list as long as shape")
    if not _all_sizes(shape) or not _all_sizes(strides):
        raise InvalidArgument("shape and strides must be non-negative integers")
    numel = 1
    for n in shape:
        numel *= n
    if numel and _dense_order(shape, strides) is None:
        raise InvalidArgument("strides must describe a dense, non-overlapping layout")
    return dtype, shape, strides, numel * dtype.itemsize


def _all_sizes(xs: list) -> bool:
    return all(type(n) is int and 0 <= n < (1 << 62) for n in xs)


def contiguous_strides(shape: list[int]) -> list[int]:
    strides, acc = [0] * len(shape), 1
    for d in range(len(shape) - 1, -1, -1):
        strides[d] = acc
        acc *= max(shape[d], 1)
    return strides


def to_wire(t: torch.Tensor) -> tuple[dict[str, Any], torch.Tensor]:
    """(descriptor, flat uint8 CPU tensor of exactly its bytes), copying only if needed."""
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    shape, strides = list(t.shape), list(t.stride())
    order = _dense_order(shape, strides) if t.numel() else None
    if order is None:
        t = t.contiguous()
        shape, strides, order = list(t.shape), list(t.stride()), list(range(t.dim()))
    desc = {"dtype": dtype_name(t.dtype), "shape": shape, "strides": strides}
    flat = t.permute(order) if order != list(range(t.dim())) else t
    flat = flat.reshape(-1)  # dense in this order: a view, never a copy
    if flat.numel() == 0:
        return desc, torch.empty(0, dtype=torch.uint8, device="cpu")
    if flat.stride(0) != 1:  # one element reached through a stride-0 (expanded) dim
        flat = flat.as_strided((flat.numel(),), (1,))
    return desc, flat.view(torch.uint8)


def from_wire(desc: dict[str, Any], raw: torch.Tensor) -> torch.Tensor:
    """Rebuild a tensor over ``raw`` (a flat uint8 tensor) without copying."""
    dtype, shape, strides, nbytes = validate(desc)
    if raw.numel() != nbytes:
        raise InvalidArgument(f"descriptor needs {nbytes} bytes, got {raw.numel()}")
    if nbytes == 0:
        return torch.empty_strided(shape, strides, dtype=dtype, device="cpu")
    return raw.view(dtype).as_strided(shape, strides)
