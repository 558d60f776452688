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
    """A tensor over ``storage`` with ``t``'s dtype, sizes, strides and offset."""
    out = torch.empty((), dtype=t.dtype, device=t.device)
    return out.set_(storage, t.storage_offset(), t.size(), t.stride())


def copied(values: list[Any]) -> list[Any]:
    """``values`` out of the graph's buffers. A tensor that is the whole of its storage is
    copied with the others in one ``_foreach_copy_`` (one launch; on this path a worker
    spent half its time copying a training step's gradients one by one, three calls each).
    A view's storage is copied whole, so that it keeps its strides and offset as the
    compiled run gives them."""
    dst: list[torch.Tensor] = []
    src: list[torch.Tensor] = []

    def out(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            if not whole(v):
                return view_of(v.untyped_storage().clone(), v)
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
