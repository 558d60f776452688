"""Request accounting: counts and latency histograms by message kind and outcome.

Workers keep one of these and ship ``snapshot()`` with their stats; the supervisor keeps
one for its own requests. The stats document carries them per worker, and both
`djinn top` (rates, latency) and the Prometheus endpoint (histograms) read them there.

Note [recent window]: totals since start are what Prometheus wants (it takes its own
differences), but percentiles over a worker's whole uptime hide what happens now: after
a day of fast requests, ten minutes of slow ones barely move a p99. Each series also
carries ``recent``, the same histogram over about the last ``window_s`` seconds. It costs
``record()`` nothing: every ``window_s / SLOTS`` seconds the totals are copied into a
ring, and ``recent`` is the totals now minus the oldest copy still inside the window.
So the window is ``window_s`` plus at most one slot; ``recent_s`` says exactly how much.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from typing import Any

SLOTS = 12  # copies of the totals per window: the window is exact to 1/SLOTS of it

# Upper bounds in seconds; each bucket counts the requests that fell in it (not cumulative:
# the metrics endpoint accumulates). One extra bucket past the last bound is +Inf.
BUCKETS = (
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    1e-2,
    2.5e-2,
    5e-2,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


class RequestStats:
    def __init__(self, window_s: float = 60.0, clock=time.monotonic) -> None:
        self._series: dict[tuple[str, str], list[Any]] = {}  # -> [count, sum_s, bucket counts]
        self.window_s = window_s
        self._clock = clock
        self._slot_s = window_s / SLOTS
        start = clock()
        self._ring: deque[tuple[float, dict]] = deque([(start, {})])  # (when, totals then)
        self._next_copy = start + self._slot_s

    def _roll(self, now: float) -> None:
        """Note [recent window]: copy the totals once per slot; forget copies too old."""
        if now < self._next_copy:
            return
        self._ring.append((now, {k: (c, t, b[:]) for k, (c, t, b) in self._series.items()}))
        self._next_copy = now + self._slot_s
        while len(self._ring) > 1 and self._ring[1][0] <= now - self.window_s:
            self._ring.popleft()

    def record(self, kind: str, outcome: str, seconds: float) -> None:
        self._roll(self._clock())
        entry = self._series.get((kind, outcome))
        if entry is None:
            entry = self._series[(kind, outcome)] = [0, 0.0, [0] * (len(BUCKETS) + 1)]
        entry[0] += 1
        entry[1] += seconds
        entry[2][bisect.bisect_left(BUCKETS, seconds)] += 1

    def snapshot(self, roll: bool = True) -> list[dict[str, Any]]:
        """Totals since start per (kind, outcome), each with its ``recent`` part.
        ``roll=False`` only reads: for a thread other than the one that records."""
        now = self._clock()
        if roll:
            self._roll(now)
        since, base = self._ring[0]
        out = []
        for key, (c, s, b) in sorted(self._series.items()):
            c0, s0, b0 = base.get(key, (0, 0.0, [0] * len(b)))
            recent = {
                "count": c - c0,
                "sum_s": round(s - s0, 6),
                "buckets": [n - n0 for n, n0 in zip(b, b0, strict=True)],
                "recent_s": round(now - since, 3),
            }
            kind, outcome = key
            out.append(
                {
                    "kind": kind,
                    "outcome": outcome,
                    "count": c,
                    "sum_s": round(s, 6),
                    "buckets": b[:],
                    "recent": recent,
                }
            )
        return out


def recent(series: dict[str, Any]) -> dict[str, Any]:
    """A series' recent part (Note [recent window]); the totals where a document predates it."""
    return series.get("recent") or series


def quantile(series: list[dict[str, Any]], q: float) -> float | None:
    """Approximate quantile (seconds) over several snapshots' buckets, or None if empty.
    Pass ``[recent(s) for s in series]`` for the recent window."""
    counts = [0] * (len(BUCKETS) + 1)
    for s in series:
        for i, n in enumerate(s["buckets"]):
            counts[i] += n
    total = sum(counts)
    if not total:
        return None
    rank, seen = q * total, 0
    for i, n in enumerate(counts):
        seen += n
        if seen >= rank:
            return BUCKETS[i] if i < len(BUCKETS) else BUCKETS[-1]
    return BUCKETS[-1]


def percentiles(series: list[dict[str, Any]]) -> dict[str, Any]:
    """Count, errors and p50/p90/p99 (seconds, bucket upper bounds) of the recent window
    over ``series`` (Note [recent window])."""
    parts = [recent(s) for s in series]
    return {
        "count": sum(int(p["count"]) for p in parts),
        "errors": sum(int(recent(s)["count"]) for s in series if s.get("outcome") != "ok"),
        "p50_s": quantile(parts, 0.5),
        "p90_s": quantile(parts, 0.9),
        "p99_s": quantile(parts, 0.99),
    }
