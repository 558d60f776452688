"""Moving storages between a device and the host tier (the shared-memory arena).

Note [swap by storage resize]: a storage is swapped out by copying its bytes into an
arena slab and then resizing the storage to 0 bytes, which frees its memory while every
tensor viewing it (tied weights, a KV cache's views) keeps its identity, shape and
strides. Swapping in resizes it back and copies the bytes home, so the module or cache
that holds those tensors is untouched and nothing has to be rebuilt or re-pointed. A
storage is either wholly on the device or wholly on the host; nothing reads a swapped-out
storage because the memory manager restores a call's working set before it runs.

On a CPU worker both copies are a memcpy. On CUDA the arena is page-locked
(``cudaHostRegister``), and copies run on a side stream ordered after the compute stream
(``wait_stream``) with ``non_blocking`` DMA; the side stream is synchronised before a slab
is freed (swap-in) or a device storage is released (swap-out), so neither is reused while
a copy may still read it.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .slabs import SlabAllocator


@dataclass
class HostCopy:
    """A swapped-out storage and where its bytes wait in the arena."""

    storage: torch.UntypedStorage
    offset: int
    nbytes: int


def _bytes_of(storage: torch.UntypedStorage, nbytes: int) -> torch.Tensor:
    """A flat uint8 view of a whole storage."""
    view = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return view.set_(storage, 0, (nbytes,), (1,))


def movable(storage: torch.UntypedStorage) -> bool:
    """Storages a swap can free: resizable (not arena slabs or other borrowed memory)
    and holding bytes."""
    return storage.nbytes() > 0 and storage.resizable()


class TierMover:
    def __init__(
        self,
        device: torch.device,
        slabs: SlabAllocator,
        slab_tensor: Callable[[int, int], torch.Tensor],
    ) -> None:
        self.device = device
        self.slabs = slabs
        self.slab_tensor = slab_tensor
        self.cuda = device.type == "cuda"
        self._side = torch.cuda.Stream(device) if self.cuda else None
        self.bytes_out = 0
        self.bytes_in = 0
        self.seconds_out = 0.0  # time spent copying, for swap throughput in the stats
        self.seconds_in = 0.0
        self._base: int | None = None  # the arena's address, less slab offsets (CPU copies)

    def out(self, storages: list[torch.UntypedStorage]) -> list[HostCopy]:
        """Copy ``storages`` to the host and free them on the device. All or nothing: a
        full arena raises RESOURCE_EXHAUSTED before any storage is touched."""
        copies: list[HostCopy] = []
        try:
            for st in storages:
                copies.append(HostCopy(st, self.slabs.alloc(st.nbytes()), st.nbytes()))
        except BaseException:
            for c in copies:
                self.slabs.free(c.offset)
            raise
        started = time.perf_counter()
        if self.cuda:
            self._copy(
                [
                    (self.slab_tensor(c.offset, c.nbytes), _bytes_of(c.storage, c.nbytes))
                    for c in copies
                ]
            )
        else:
            # Note [single-threaded memcpy]: torch's copy_ splits a copy over its intra-op
            # threads, and on a busy machine waits for the slowest of them: 3.6 MB took
            # 8 ms (0.45 GB/s) on 2 loaded cores, a plain memcpy 0.15 ms. (Not through
            # numpy: exporting a storage to numpy makes it unresizable.) Addresses, not
            # tensors: no per-storage tensor objects on the way.
            for c in copies:
                ctypes.memmove(self._slab_address(c), c.storage.data_ptr(), c.nbytes)
        self.seconds_out += time.perf_counter() - started
        for c in copies:
            c.storage.resize_(0)
            self.bytes_out += c.nbytes
        return copies

    def back(self, copies: list[HostCopy]) -> None:
        """Give each storage its bytes again and free the slabs."""
        started = time.perf_counter()
        if self.cuda:
            pairs = []
            for c in copies:
                c.storage.resize_(c.nbytes)
                pairs.append((_bytes_of(c.storage, c.nbytes), self.slab_tensor(c.offset, c.nbytes)))
            self._copy(pairs)
        else:
            # into warm heap pages (Note [warm heap], memtrim.py), straight from the slab
            for c in copies:
                c.storage.resize_(c.nbytes)
                ctypes.memmove(c.storage.data_ptr(), self._slab_address(c), c.nbytes)
        self.seconds_in += time.perf_counter() - started
        for c in copies:
            self.slabs.free(c.offset)
            self.bytes_in += c.nbytes

    def _slab_address(self, c: HostCopy) -> int:
        """Where a CPU copy's slab starts, without making a tensor of it per copy."""
        if self._base is None:
            self._base = self.slab_tensor(c.offset, c.nbytes).data_ptr() - c.offset
        return self._base + c.offset

    def _copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """dst.copy_(src) for each pair, as DMA on the side stream (CUDA), finished
        before returning."""
        side, compute = self._side, torch.cuda.current_stream(self.device)
        side.wait_stream(compute)  # what the compute stream wrote is there to copy
        with torch.cuda.stream(side):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
        compute.wait_stream(side)
        side.synchronize()
