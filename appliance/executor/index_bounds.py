"""Index and probability values checked before a GPU kernel sees them.

Note [indices on a GPU]: a CPU kernel given an index out of range raises (IndexError,
"index 9 is out of bounds for dimension 0 with size 4"), and the request fails alone. The
CUDA kernels of the same ops check on the device instead: a device-side assert, which is
*sticky*. Every later CUDA call of the worker's process fails, for every session on it,
until the process ends (seen on an H200: one ``embedding`` with index 7 into 4 rows, then
the ops of 50 other tests failed). Note [a lost GPU context] (device.py) bounds the
damage: the worker restarts. This module keeps the common cases from getting that far.
On a worker whose device is not the CPU, the ops below have their index (or probability)
values read before the kernel runs, and a value the CPU kernel would refuse fails the op
with the CPU's words, as an ExecutionError. That costs one reduction and one device sync
per such op; CPU workers skip it, since their kernels check as they go.

Each rule mirrors what the CPU kernel accepts (``tests/unit/test_index_bounds.py`` checks
that on every value around the bounds): negative indices wrap for ``index``,
``index_put_``, ``index_fill``, ``take`` and ``put_``, and are refused by ``index_select``,
``gather``, ``scatter*``, ``index_add_``/``index_copy_``/``index_reduce_``, ``embedding``
and the embedding bag. Labels and values too: the margin losses' targets, binary cross
entropy's input and target within [0, 1], ``bernoulli``'s and ``multinomial``'s
probabilities, ``poisson``'s rate, ``max_unpool``'s indices, an embedding bag's offsets.
(nll_loss's targets are checked on every device, ``opchecks._class_targets``: its CPU
backward writes by them unchecked.) An execution plan runs these again on every run
(Note [value checks in a plan], plan.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from djinn.errors import ExecutionError

from .opchecks import by_op

Guard = Callable[[str, dict[str, Any]], None]


def _bounds(op: str, index: Any, size: int, dim: int, wraps: bool, low: int = 0) -> None:
    """Every value of ``index`` within ``[-size, size)`` (``wraps``) or ``[low, size)``."""
    if not isinstance(index, torch.Tensor) or not index.numel():
        return
    if index.dtype == torch.bool or index.is_floating_point() or index.is_complex():
        return  # masks are checked on the host by shape; the kernel refuses the others
    lo, hi = (int(v) for v in torch.aminmax(index))  # one reduction, one sync
    low = -size if wraps else low
    for value in (lo, hi):
        if not low <= value < size:
            raise ExecutionError(
                f"{op}: index {value} is out of bounds for dimension {dim} with size {size}"
            )


def _dim(a: dict[str, Any], x: torch.Tensor) -> int:
    dim = a.get("dim", 0)
    if not isinstance(dim, int) or not -max(1, x.dim()) <= dim < max(1, x.dim()):
        return -1  # the schema and meta checks refuse it
    return dim % max(1, x.dim())


def _along_dim(wraps: bool, index_key: str = "index") -> Guard:
    """``op(self, dim, index, ...)``: ``index`` picks along ``dim`` of ``self``."""

    def guard(op: str, a: dict[str, Any]) -> None:
        x = a.get("self")
        if not isinstance(x, torch.Tensor):
            return
        dim = _dim(a, x)
        if dim >= 0:
            size = x.shape[dim] if x.dim() else 1
            _bounds(op, a.get(index_key), size, dim, wraps)

    return guard


def _advanced(op: str, a: dict[str, Any]) -> None:
    """``x[i0, i1, ...]`` and ``index_put_``: each long index wraps within its dim; a bool
    mask covers as many dims as it has."""
    x, indices = a.get("self"), a.get("indices")
    if not isinstance(x, torch.Tensor) or not isinstance(indices, (list, tuple)):
        return
    dim = 0
    for index in indices:
        if isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8):
            dim += index.dim()  # a 0-dim mask covers no dimension, as ATen counts it
            continue
        if dim >= x.dim():
            return  # too many indices: the meta check refuses it
        if index is not None:
            _bounds(op, index, x.shape[dim], dim, wraps=True)
        dim += 1


def _flat(op: str, a: dict[str, Any]) -> None:
    """``take`` / ``put_``: the index runs over the flattened ``self``, and wraps."""
    x = a.get("self")
    if isinstance(x, torch.Tensor):
        _bounds(op, a.get("index"), x.numel(), 0, wraps=True)


def _embedding(op: str, a: dict[str, Any]) -> None:
    weight = a.get("weight")
    if isinstance(weight, torch.Tensor) and weight.dim():
        _bounds(op, a.get("indices"), weight.shape[0], 0, wraps=False)


def _embedding_renorm(op: str, a: dict[str, Any]) -> None:
    """The CPU picks each row with ``select``, which wraps a negative index; CUDA's kernel
    multiplies it by the row stride unchecked (a read and write before the weight), so
    here a negative index is refused too: stricter than the CPU, as F.embedding, which
    follows it, refuses negative indices anyway."""
    weight = a.get("self")
    if isinstance(weight, torch.Tensor) and weight.dim():
        _bounds(op, a.get("indices"), weight.shape[0], 0, wraps=False)


def _embedding_backward(op: str, a: dict[str, Any]) -> None:
    rows, padding = a.get("num_weights"), a.get("padding_idx", -1)
    indices = a.get("indices")
    if isinstance(rows, int) and isinstance(indices, torch.Tensor):
        _bounds(op, indices[indices != padding], rows, 0, wraps=False)


def _in_range(op: str, t: Any, low: float, high: float, what: str) -> None:
    """Every value of ``t`` within [low, high] (NaN outside), in ``t``'s own dtype."""
    if not isinstance(t, torch.Tensor) or not t.numel() or not t.is_floating_point():
        return
    lo, hi = (float(v) for v in torch.aminmax(t.detach()))
    if not low <= lo <= hi <= high:
        raise ExecutionError(f"{op}: {what}")


def _targets(low: int) -> Guard:
    """``multi_margin_loss`` (low 0) and ``multilabel_margin_loss`` (low -1, the end of a
    row's labels): every target within [low, classes), classes the input's last dim."""

    def guard(op: str, a: dict[str, Any]) -> None:
        x = a.get("self")
        if isinstance(x, torch.Tensor) and x.dim():
            _bounds(op, a.get("target"), x.shape[-1], x.dim() - 1, wraps=False, low=low)

    return guard


def _binary_cross_entropy(op: str, a: dict[str, Any]) -> None:
    _in_range(op, a.get("self"), 0.0, 1.0, "all elements of input should be between 0 and 1")
    _in_range(op, a.get("target"), 0.0, 1.0, "all elements of target should be between 0 and 1")


def _poisson(op: str, a: dict[str, Any]) -> None:
    rate = a.get("self")
    _in_range(op, rate, 0.0, float("inf"), "invalid Poisson rate, expected rate to be non-negative")


def _max_unpool(op: str, a: dict[str, Any]) -> None:
    size = a.get("output_size")
    if isinstance(size, (list, tuple)) and all(isinstance(n, int) for n in size):
        _bounds(op, a.get("indices"), math.prod(size), 0, wraps=False)


def _embedding_bag(op: str, a: dict[str, Any]) -> None:
    """Indices within the weight's rows (``padding_idx`` too, as the CPU checks); offsets
    from 0, never decreasing, at most the number of indices."""
    weight, indices, offsets = a.get("weight"), a.get("indices"), a.get("offsets")
    if not isinstance(weight, torch.Tensor) or not weight.dim():
        return
    _bounds(op, indices, weight.shape[0], 0, wraps=False)
    if not isinstance(offsets, torch.Tensor) or not isinstance(indices, torch.Tensor):
        return
    if offsets.dim() != 1 or not offsets.numel() or offsets.is_floating_point():
        return
    n = indices.numel()
    first, last = int(offsets[0]), int(offsets[-1])
    if first != 0 or last > n or bool((offsets[1:] < offsets[:-1]).any()):
        raise ExecutionError(
            f"{op}: offsets must start at 0, never decrease, and end within the {n} indices"
        )


def _probabilities(key: str, row_sums: bool) -> Guard:
    """``bernoulli``'s ``p`` within [0, 1]; ``multinomial``'s weights finite, not
    negative, and (``row_sums``) each distribution's sum positive."""

    def guard(op: str, a: dict[str, Any]) -> None:
        # bernoulli.default draws by ``self``'s values; bernoulli_.Tensor by ``p``'s
        p = a.get(key) if key in a else a.get("self")
        if not isinstance(p, torch.Tensor) or not p.numel() or not p.is_floating_point():
            return
        lo, hi = (float(v) for v in torch.aminmax(p.detach()))  # its own dtype: float64 too
        if row_sums:
            sums = p.detach().reshape(-1, p.shape[-1]).sum(-1) if p.dim() else p
            if not (lo >= 0 and hi < float("inf") and bool((sums > 0).all())):
                raise ExecutionError(
                    f"{op}: probability tensor contains either inf, nan or element < 0, "
                    "or a distribution sums to 0"
                )
        elif not 0 <= lo <= hi <= 1:
            raise ExecutionError(f"{op}: p must lie within [0, 1]")

    return guard


GUARDS: dict[str, Guard] = {
    "aten::index": _advanced,
    "aten::index_put": _advanced,
    "aten::_index_put_impl": _advanced,
    "aten::_unsafe_index_put": _advanced,
    "aten::index_select": _along_dim(wraps=False),
    "aten::gather": _along_dim(wraps=False),
    "aten::scatter": _along_dim(wraps=False),
    "aten::scatter_add": _along_dim(wraps=False),
    "aten::scatter_reduce": _along_dim(wraps=False),
    "aten::index_add": _along_dim(wraps=False),
    "aten::index_copy": _along_dim(wraps=False),
    "aten::index_reduce": _along_dim(wraps=False),
    "aten::index_fill": _along_dim(wraps=True),
    "aten::take": _flat,
    "aten::put": _flat,
    "aten::embedding": _embedding,
    "aten::embedding_dense_backward": _embedding_backward,
    "aten::embedding_renorm": _embedding_renorm,
    "aten::multinomial": _probabilities("self", row_sums=True),
    "aten::bernoulli": _probabilities("p", row_sums=False),
    "aten::poisson": _poisson,
    "aten::multi_margin_loss": _targets(0),
    "aten::multi_margin_loss_backward": _targets(0),
    "aten::multilabel_margin_loss_forward": _targets(-1),
    "aten::multilabel_margin_loss_backward": _targets(-1),
    "aten::binary_cross_entropy": _binary_cross_entropy,
    "aten::max_unpool2d": _max_unpool,
    "aten::max_unpool3d": _max_unpool,
    "aten::_embedding_bag_forward_only": _embedding_bag,
    "aten::_embedding_bag": _embedding_bag,
}


def has_guard(op: Any) -> bool:
    return by_op(GUARDS, op) is not None


def check(op: Any, named: dict[str, Any]) -> None:
    """Note [indices on a GPU]: refuse ``op``'s out-of-range values before its kernel."""
    guard = by_op(GUARDS, op)  # an in-place form indexes as its op does
    if guard is not None:
        guard(f"{op._schema.name}.{op._schema.overload_name or 'default'}", named)
