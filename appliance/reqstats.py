"""Request accounting: counts and latency histograms by message kind and outcome.

Workers keep one of these and ship ``snapshot()`` with their stats; the supervisor keeps
one for its own requests. The stats document carries them per worker, and both
`djinn top` (rates, latency) and the Prometheus endpoint (histograms) read them there.
"""

from __future__ import annotations

import bisect
from typing import Any

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
    def __init__(self) -> None:
        self._series: dict[tuple[str, str], list[Any]] = {}  # -> [count, sum_s, bucket counts]

    def record(self, kind: str, outcome: str, seconds: float) -> None:
        entry = self._series.get((kind, outcome))
        if entry is None:
            entry = self._series[(kind, outcome)] = [0, 0.0, [0] * (len(BUCKETS) + 1)]
        entry[0] += 1
        entry[1] += seconds
        entry[2][bisect.bisect_left(BUCKETS, seconds)] += 1

    def snapshot(self) -> list[dict[str, Any]]:
        return [
            {"kind": kind, "outcome": outcome, "count": c, "sum_s": round(s, 6), "buckets": b[:]}
            for (kind, outcome), (c, s, b) in sorted(self._series.items())
        ]


def quantile(series: list[dict[str, Any]], q: float) -> float | None:
    """Approximate quantile (seconds) over several snapshots' buckets, or None if empty."""
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
