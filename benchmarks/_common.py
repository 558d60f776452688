"""Units, the clock, byte formatting, progress notes and JSON results shared by the
benchmark scripts (``transport.py`` and the ``_*.py`` helpers beside it, ``capture.py``,
``model_path.py``)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

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


def save_json(doc: Any, target: str) -> Path | None:
    """Write ``doc`` to ``target`` (its folder created); an empty target writes nothing."""
    if not target:
        return None
    path = Path(target)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n")
    return path


def note(msg: str) -> None:
    """A progress line on stderr, named by the script that prints it (every benchmark
    shares this helper: it said ``[transport]`` for all of them)."""
    print(f"[{Path(sys.argv[0]).stem or 'benchmark'}] {msg}", file=sys.stderr, flush=True)
