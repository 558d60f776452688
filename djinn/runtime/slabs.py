"""A session's arena slabs leased ahead, and the copies into and out of the arena.

Note [lease ahead]: a bulk PUT to a same-host appliance needs a slab of the shared arena
to write the tensor's bytes into, and a slab is leased by an ALLOC request, so a put
used to be two round trips. Programs put the same shapes again and again (a training
loop's batches, a decode loop's inputs), so a PUT may also ask for slabs for the *next*
puts (``lease: [size, ...]``, answered ``leased: [offset, ...]``): when a put's sizes
were also put within the last ``IDLE_PUTS`` puts, slabs for them (as many as the last
put of that size had) are leased ahead, and the next put of that size is one round trip.
(Only the put just before used to count: a loop moving in two tensors of different
sizes, an input and its mask, ALLOCed at every put, and an ALLOC waits for the graph in
flight, which a put need not: Note [puts sent without waiting].) Spare slabs are bounded
(``budget``: at most 64 MiB and a 64th of the arena per session); a size not put again
within ``IDLE_PUTS`` puts gives its slabs back (``release``, like a reply slab that has
been read), and an ALLOC the arena refuses gives them all back and is tried once more,
so spares never cost a put that would have fitted without them. They are the session's
slabs: the appliance frees them with the session, and a session rebuilt on another
worker starts with none.
"""

from __future__ import annotations

import ctypes
import threading
from collections import Counter
from collections.abc import Iterable

import torch

ALIGN = 4096  # the appliance's slab granularity (appliance/vmu/slabs.py)
BUDGET_MAX = 64 << 20
IDLE_PUTS = 8  # puts without a size before its spare slabs are given back
LEASE_MAX = 16  # slabs one PUT may lease ahead (the appliance's limit)
# Note [one thread for an arena copy]: copies up to this size use one memmove, not torch's
# copy_. An arena copy means the appliance's worker is on this host, using its cores, and
# torch splits a copy over its intra-op threads: waiting for a descheduled sibling can cost
# more than the copy, and after the copy those OpenMP threads spin (300,000 rounds unless
# the program set GOMP_SPINCOUNT) on a core the worker needs. Reading GPT-2's 12.9 MB of
# logits that way took 7.5-8.5 ms of a core per forward on 2 cores, while the worker was
# running the next one: 136-139 ms a replayed forward against 128-134 with one memmove
# (local eager 121-125 ms in the same runs). Past some tens of MiB two threads win: a get
# writes into fresh pages, and two threads fault them in twice as fast (64 MiB: 5.2
# against 2.9 GB/s; 16 MiB, warm pages: 18.9 against 16.5).
MEMMOVE_MAX = 32 << 20


def size_class(nbytes: int) -> int:
    return max(ALIGN, -(-nbytes // ALIGN) * ALIGN)


class LeasedSlabs:
    """Spare slabs by size class; thread-safe (puts may come from several threads)."""

    def __init__(self, arena_size: int = 0) -> None:
        self.budget = min(BUDGET_MAX, arena_size // 64)
        self._spare: dict[int, list[int]] = {}
        # size class -> (the put that last had it, how many it had)
        self._last_put: dict[int, tuple[int, int]] = {}
        self._puts = 0
        self.held = 0  # bytes of spare slabs
        self._lock = threading.Lock()

    def take(self, sizes: Iterable[int]) -> list[int | None]:
        """A spare slab for each size, or None where there is none."""
        out: list[int | None] = []
        with self._lock:
            for n in sizes:
                spare = self._spare.get(size_class(n))
                if spare:
                    self.held -= size_class(n)
                    out.append(spare.pop())
                else:
                    out.append(None)
        return out

    def covers(self, sizes: Iterable[int]) -> bool:
        """Whether ``take(sizes)`` would find a spare slab for each size."""
        with self._lock:
            need = Counter(size_class(n) for n in sizes)
            return all(len(self._spare.get(c, ())) >= k for c, k in need.items())

    def plan(self, sizes: Iterable[int]) -> tuple[list[int], list[int]]:
        """After a put of ``sizes``: the slab sizes to lease ahead with its PUT, and the
        spare slabs to give back (their size has not been put for a while)."""
        with self._lock:
            self._puts += 1
            now = Counter(size_class(n) for n in sizes)
            lease: list[int] = []
            planned = self.held
            for c, count in now.items():
                # as many as the last put of this size had, if within the last IDLE_PUTS
                before = self._last_put.get(c, (0, 0))[1]
                self._last_put[c] = (self._puts, count)
                want = min(count, before) - len(self._spare.get(c, ()))
                while want > 0 and len(lease) < LEASE_MAX and planned + c <= self.budget:
                    lease.append(c)
                    planned += c
                    want -= 1
            unused: list[int] = []
            for c in [c for c, (at, _) in self._last_put.items() if at < self._puts - IDLE_PUTS]:
                del self._last_put[c]
                given = self._spare.pop(c, [])
                self.held -= c * len(given)
                unused.extend(given)
            return lease, unused

    def add(self, leased: Iterable[int], sizes: Iterable[int]) -> None:
        with self._lock:
            for off, c in zip(leased, sizes, strict=False):
                self._spare.setdefault(c, []).append(off)
                self.held += c

    def drain(self) -> list[int]:
        """Every spare slab, to be given back."""
        with self._lock:
            out = [off for spare in self._spare.values() for off in spare]
            self._spare.clear()
            self.held = 0
            return out


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for two flat uint8 tensors of the same length."""
    n = src.numel()
    if dst.numel() != n:  # a memmove would write past the end of dst
        raise ValueError(f"copy of {n} bytes into {dst.numel()}")
    if n <= MEMMOVE_MAX and dst.is_contiguous() and src.is_contiguous():
        if n:
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), n)
    else:
        dst.copy_(src)
