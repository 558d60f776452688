"""Give the C heap's free pages back to the kernel once a worker goes idle.

Note [heap trim]: tensors a session frees go back to glibc's malloc, which keeps the
pages for reuse. Between bursts of sessions that is memory the worker holds and nobody
uses; by the next burst it is fragmented differently and RSS ratchets up a little each
time (benchmarks/soak.py). ``malloc_trim(0)`` returns every whole free page. It costs a
walk of the heap (about a millisecond here), so the worker calls it only when sessions
have ended and the loop has nothing to do, never on a request's path. Where the C
library is not glibc it is a no-op.
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


def trim_heap() -> bool:
    """True if the C library released memory to the kernel."""
    return bool(_trim(0)) if _trim is not None else False
