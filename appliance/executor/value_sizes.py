"""Bytes an op whose output size is a value of its input will allocate, from that value.

Note [sizes by value]: ``bincount`` and ``repeat_interleave`` (of a tensor of repeats, no
``output_size``) have no meta kernel, so the stack cannot be asked before they run (Note
[op validation]) and the bytes they allocate were charged only after. Their output's
length is a value of their input: the largest index plus one (or ``minlength``), the sum
of the repeats. A client's ``bincount(tensor([2**40]))`` would have the worker allocate 8
TiB before anything was charged, and ``[2**63 - 1]`` made the CPU kernel's ``max + 1``
wrap to a negative length, an output of ``minlength`` elements, and a write past it. So
before such a kernel runs, its output's bytes are computed here from the values, in Python
integers (no wrap), and must fit in the stack like any op's; the values the kernels index
by without a check are checked in ``opchecks`` (``_repeats``), which compiled plans run
too. An output element is counted as 8 bytes: ``bincount``'s is int64 or its weights'
floating type, ``repeat_interleave``'s its repeats' integer type, never wider.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

ELEMENT_BOUND = 8  # bytes


def _integral(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and not (
        x.is_floating_point() or x.is_complex() or x.dtype == torch.bool
    )


def _bincount(a: dict[str, Any]) -> int | None:
    x, minlength = a.get("self"), a.get("minlength", 0)
    if not _integral(x) or x.dim() != 1 or not isinstance(minlength, int):
        return None  # the kernel refuses it before allocating
    top = int(x.max()) + 1 if x.numel() else 0
    return max(top, minlength, 0) * ELEMENT_BOUND


def _repeat_interleave(a: dict[str, Any]) -> int | None:
    repeats = a.get("repeats")
    if not _integral(repeats) or repeats.dim() != 1 or not repeats.numel():
        return None
    top = int(repeats.max())
    if top <= 0:
        return 0
    # a bound without wrapping int64: the sum is at most top * numel (the negative repeats
    # the kernel refuses are refused first, in opchecks._repeats)
    if top * repeats.numel() >= 1 << 62:
        return (1 << 62) * ELEMENT_BOUND
    return int(repeats.sum()) * ELEMENT_BOUND


SIZES: dict[str, Callable[[dict[str, Any]], int | None]] = {
    "aten::bincount": _bincount,
    "aten::repeat_interleave": _repeat_interleave,
}


def output_bytes(op: Any, named: dict[str, Any]) -> int | None:
    """The bytes ``op`` will allocate by its arguments' values (Note [sizes by value]), or
    None when they do not decide it (another op, or arguments its kernel refuses)."""
    size = SIZES.get(op._schema.name)
    return None if size is None else size(named)
