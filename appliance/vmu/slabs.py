"""Slab allocation inside one worker's share of the host arena.

First fit over a sorted free list, coalescing on free. Slabs are page-aligned (DMA likes
that, and only bulk tensors come here: small ones travel inside frames), and there are
rarely more than a few hundred live at once, so a list beats anything cleverer.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

from djinn.errors import QuotaExceeded, ResourceExhausted

ALIGN = 4096


class SlabAllocator:
    """Note [arena shares]: slabs allocated for a session carry its id, and a session may
    hold at most ``session_max`` of the arena. Beyond its fair share (capacity divided
    by the open sessions plus one yet to come) it may not take the last ``reserve``
    bytes either: those are kept for sessions under their share. One session (or a few)
    filling the arena thus gets RESOURCE_EXHAUSTED; the others keep room to PUT and fetch.
    """

    def __init__(
        self,
        base: int,
        capacity: int,
        session_max: float = 1.0,
        reserve: float = 0.0,
        sessions: Callable[[], int] = lambda: 1,
    ) -> None:
        self.base = base
        self.capacity = capacity
        self._free: list[tuple[int, int]] = [(base, capacity)] if capacity else []
        self._live: dict[int, int] = {}
        self._owner: dict[int, str] = {}
        self.held: dict[str, int] = {}  # session id -> slab bytes it holds
        self.session_max = int(capacity * session_max)
        self.reserve = int(capacity * reserve)
        self.sessions = sessions
        self.used = 0
        self.peak = 0
        # issue 9 §4: a hard per-session quota (session_host_max; 0: none) over its slabs
        # and what else it holds in the host tier (its KV caches swapped out)
        self.host_max = 0
        self.host_elsewhere: Callable[[str], int] = lambda owner: 0
        # tenant_host_max (Note [tenant quotas], tenant_quota.py), set by the worker
        self.tenant_host: Callable[[str, int], None] = lambda owner, size: None

    def _check_share(self, owner: str, size: int) -> None:
        held = self.held.get(owner, 0) + size
        if self.host_max and held + self.host_elsewhere(owner) > self.host_max:
            raise QuotaExceeded(
                f"host memory: this session would hold {held + self.host_elsewhere(owner)} "
                f"bytes in the host tier, over its quota of {self.host_max} "
                "(session_host_max); free handles or KV caches first"
            )
        self.tenant_host(owner, size)
        # the quota protects other sessions: a session alone on the worker is bounded by
        # the reserve below only (a lone user may load a model over half the arena)
        if held > self.session_max and self.sessions() > 1:
            raise ResourceExhausted(
                f"host arena: this session would hold {held} bytes, over its quota of "
                f"{self.session_max} (arena_session_max); free handles first"
            )
        fair = self.capacity // (self.sessions() + 1)  # counting a session yet to come
        if held > fair and self.capacity - self.used - size < self.reserve:
            raise ResourceExhausted(
                f"host arena: this session holds more than its fair share ({fair} bytes) "
                f"and the last {self.reserve} bytes are kept for other sessions "
                "(arena_reserve); free handles first"
            )

    def alloc(self, nbytes: int, owner: str | None = None) -> int:
        """Offset of a new slab of at least ``nbytes`` for session ``owner``;
        RESOURCE_EXHAUSTED if none fits or the session is over its share."""
        size = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        if owner is not None:
            self._check_share(owner, size)
        for i, (off, length) in enumerate(self._free):
            if length >= size:
                if length == size:
                    del self._free[i]
                else:
                    self._free[i] = (off + size, length - size)
                self._live[off] = size
                if owner is not None:
                    self._owner[off] = owner
                    self.held[owner] = self.held.get(owner, 0) + size
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
        owner = self._owner.pop(off, None)
        if owner is not None:
            left = self.held[owner] - size
            if left:
                self.held[owner] = left
            else:
                del self.held[owner]
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
