"""What a CUDA graph of a plan reads and writes outside the graph: its inputs copied in,
its results copied out (Note [CUDA graphs for plans], ``cuda_graphs.py``). A replay
writes the same buffers every time, so what a session keeps of one run is a copy."""

from __future__ import annotations

from typing import Any

import torch

from .metacheck import tensors_of


def whole(t: torch.Tensor) -> bool:
    """Contiguous and the whole of its storage."""
    return (
        t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    )


def ownable(t: torch.Tensor, ins: list[torch.Tensor]) -> bool:
    """Whether input ``t`` can be copied into a buffer of the graph's own before each
    replay: whole, and no other input shares its storage."""
    ptr = t.untyped_storage().data_ptr()
    return whole(t) and sum(1 for u in ins if u.untyped_storage().data_ptr() == ptr) == 1


def check_outputs(values: list[Any], ins: list[torch.Tensor]) -> None:
    """Kept and fetched values must share no storage with an input or each other (Note [CUDA
    graphs for plans])."""
    seen = {t.untyped_storage().data_ptr() for t in ins}
    for t in tensors_of(values):
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            raise ValueError("a kept value shares storage with an input or another value")
        seen.add(ptr)


def view_of(storage: Any, t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``storage`` with ``t``'s dtype, sizes, strides and offset, and its
    conjugate and negative bits (a review found a kept ``_conj`` of a slice read back
    unconjugated: the bits are not in the storage)."""
    out = torch.empty((), dtype=t.dtype, device=t.device)
    out = out.set_(storage, t.storage_offset(), t.size(), t.stride())
    if t.is_conj():
        out = out.conj()
    if t.is_neg():
        out = out._neg_view()
    return out


# the dtypes CUDA's _foreach_copy_ takes on its fast path (one launch for the list), which
# it takes whenever every tensor has the same dtype: it has no kernel for the others (a
# review found uint16/32/64, which the protocol allows, and float8 on older torch)
FOREACH_DTYPES = frozenset({
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
    torch.complex128, torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32,
    torch.int64,
})  # fmt: skip


def copied(values: list[Any]) -> list[Any]:
    """``values`` out of the graph's buffers. A tensor that is the whole of its storage is
    copied with the others in one ``_foreach_copy_`` (one launch; on this path a worker
    spent half its time copying a training step's gradients one by one, three calls each),
    unless its dtype or bits keep it off the fast path (``FOREACH_DTYPES``): then alone. A
    view's storage is copied whole, so that it keeps its strides and offset as the
    compiled run gives them."""
    dst: list[torch.Tensor] = []
    src: list[torch.Tensor] = []

    def out(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            if not whole(v):
                return view_of(v.untyped_storage().clone(), v)
            if v.dtype not in FOREACH_DTYPES or v.is_conj() or v.is_neg():
                return v.clone()  # strides kept: a whole tensor is dense
            dst.append(torch.empty_like(v))
            src.append(v)
            return dst[-1]
        if isinstance(v, tuple):
            return tuple(out(u) for u in v)
        if isinstance(v, list):
            return [out(u) for u in v]
        return v

    copied = [out(v) for v in values]
    if dst:
        torch._foreach_copy_(dst, src)
    return copied
