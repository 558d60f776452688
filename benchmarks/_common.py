"""Units, the clock, byte formatting and progress notes shared by the transport benchmark's
modules (``transport.py`` and the ``_*.py`` helpers beside it)."""

from __future__ import annotations

import sys
import time

MiB = 1 << 20
GiB = 1 << 30
TRANSPORTS = ("unix", "tcp")

clock = time.perf_counter_ns


def seconds_since(t0: int) -> float:
    return (clock() - t0) / 1e9


def fmt_bytes(n: int) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def note(msg: str) -> None:
    print(f"[transport] {msg}", file=sys.stderr, flush=True)
