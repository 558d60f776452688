"""Slab allocation inside one worker's share of the host arena.

First fit over a sorted free list, coalescing on free. Slabs are page-aligned (DMA likes
that, and only bulk tensors come here: small ones travel inside frames), and there are
rarely more than a few hundred live at once, so a list beats anything cleverer.
"""

from __future__ import annotations

import bisect

from djinn.errors import ResourceExhausted

ALIGN = 4096


class SlabAllocator:
    def __init__(self, base: int, capacity: int) -> None:
        self.base = base
        self.capacity = capacity
        self._free: list[tuple[int, int]] = [(base, capacity)] if capacity else []
        self._live: dict[int, int] = {}
        self.used = 0
        self.peak = 0

    def alloc(self, nbytes: int) -> int:
        """Offset of a new slab of at least ``nbytes``; RESOURCE_EXHAUSTED if none fits."""
        size = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        for i, (off, length) in enumerate(self._free):
            if length >= size:
                if length == size:
                    del self._free[i]
                else:
                    self._free[i] = (off + size, length - size)
                self._live[off] = size
                self.used += size
                self.peak = max(self.peak, self.used)
                return off
        raise ResourceExhausted(
            f"host arena: no free slab of {nbytes} bytes "
            f"({self.capacity - self.used} of {self.capacity} free, fragmented into "
            f"{len(self._free)} pieces); free handles or raise arena_bytes"
        )

    def free(self, off: int) -> None:
        size = self._live.pop(off)
        self.used -= size
        i = bisect.bisect(self._free, (off, size))
        # merge with the following and preceding free ranges
        if i < len(self._free) and off + size == self._free[i][0]:
            size += self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == off:
            prev_off, prev_size = self._free[i - 1]
            self._free[i - 1] = (prev_off, prev_size + size)
        else:
            self._free.insert(i, (off, size))

    def size_of(self, off: int) -> int | None:
        return self._live.get(off)

    def stats(self) -> dict[str, int]:
        return {"capacity": self.capacity, "used": self.used, "peak": self.peak}
