"""Give the C heap's free pages back to the kernel once a worker goes idle.

Note [heap trim]: tensors a session frees go back to glibc's malloc, which keeps the
pages for reuse. Between bursts of sessions that is memory the worker holds and nobody
uses; by the next burst it is fragmented differently and RSS ratchets up a little each
time (benchmarks/soak.py). ``malloc_trim(0)`` returns every whole free page. It costs a
walk of the heap (about a millisecond here), so the worker calls it only when sessions
have ended and the loop has nothing to do, never on a request's path. Where the C
library is not glibc it is a no-op.

Note [warm heap]: on a CPU worker, "device memory" is this process's heap, and a swap-in
(Note [swap by storage resize]) copies a storage's bytes into memory it has just
allocated. glibc serves large allocations with fresh ``mmap``s and returns them with
``munmap`` (and trims the heap's top past a threshold), so every swap-in wrote into
pages the kernel first had to fault in and zero: swap-in ran at 0.13-0.4x memcpy
(0.87 GB/s against 3.7 GB/s for a 36 MiB KV cache; 1.0 against 7.8 GB/s for 96 MiB
storages). ``keep_heap_warm`` makes malloc take everything from the heap
(``M_MMAP_MAX`` 0) and never trim it by itself (``M_TRIM_THRESHOLD``), like a GPU's
caching allocator keeps device memory: a swap-in reuses warm pages a swap-out freed and
copies at memcpy speed (0.94-1.1x in the same measurement). The cost is that freed
memory stays in the worker's RSS until ``trim_heap`` runs (idle, after sessions ended);
the VMU still bounds the live bytes by ``cpu_worker_memory``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable


def _load() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_trim = _load()
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # mallopt parameters (malloc.h)


def keep_heap_warm() -> bool:
    """Note [warm heap]. True if the C library took the settings."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # M_TRIM_THRESHOLD takes an int: the largest one means "never"
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, (1 << 31) - 1))


def trim_heap() -> bool:
    """True if the C library released memory to the kernel."""
    return bool(_trim(0)) if _trim is not None else False
