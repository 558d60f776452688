"""Request rate and latency from the `requests` section of the stats document.

The document only carries totals since each worker started (count, sum, histogram
buckets per kind and outcome). A rate needs two samples: `RateTracker` keeps the previous
totals and divides the difference by the appliance's own uptime difference, so the rate
is independent of how late a poll was answered (and deterministic under test).
Latency quantiles come from the buckets via the appliance's `quantile` helper, over the
recent window each series carries (Note [recent window], appliance/reqstats.py: the
last `stats_window` seconds), so a slow spell shows now, not diluted by the whole uptime.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from djinn.appliance.reqstats import quantile, recent

from .table import Cell, Column, Rows

REQUEST_COLUMNS = [
    Column("worker", "worker"),
    Column("count", "requests", numeric=True),
    Column("rate", "req/s", numeric=True),
    Column("errors", "errors", numeric=True),
    Column("p50", "p50", numeric=True),
    Column("p99", "p99", numeric=True),
]

TOTAL = "all"


def fmt_latency(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f}µs"
    if seconds < 1:
        return f"{seconds * 1e3:g}ms"
    return f"{seconds:g}s"


def fmt_rate(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:.1f}"


def by_worker(doc: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """The document's request series grouped by worker id (as a string), in order."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for series in doc.get("requests", []):
        if isinstance(series.get("buckets"), list):
            groups[str(series.get("worker", "?"))].append(series)
    return dict(groups)


class RateTracker:
    """Requests per second per worker (and in total) between two consecutive documents."""

    def __init__(self) -> None:
        self._prev: dict[str, int] = {}
        self._prev_clock: tuple[Any, float] | None = None  # (appliance pid, uptime_s)

    def update(self, doc: dict[str, Any], totals: dict[str, int]) -> dict[str, float | None]:
        app = doc.get("appliance", {})
        clock = (app.get("pid"), float(app.get("uptime_s", 0.0)))
        prev, prev_clock = self._prev, self._prev_clock
        self._prev, self._prev_clock = dict(totals), clock
        # No baseline yet, a new appliance (pid changed), or time not moving: no rate.
        if prev_clock is None or prev_clock[0] != clock[0] or clock[1] <= prev_clock[1]:
            return {}
        dt = clock[1] - prev_clock[1]
        rates: dict[str, float | None] = {}
        for key, count in totals.items():
            before = prev.get(key, 0)
            # A restarted worker starts counting from zero again: skip one sample.
            rates[key] = None if count < before else (count - before) / dt
        return rates


def request_rows(groups: dict[str, list[dict[str, Any]]], rates: dict[str, float | None]) -> Rows:
    rows: Rows = {}
    for worker, series in groups.items():
        count = sum(int(s.get("count", 0)) for s in series)
        errors = sum(int(s.get("count", 0)) for s in series if s.get("outcome") != "ok")
        window = [recent(s) for s in series]
        p50, p99 = quantile(window, 0.5), quantile(window, 0.99)
        rate = rates.get(worker)
        rows[worker] = [
            Cell(worker, int(worker) if worker.isdigit() else worker),
            Cell(str(count), count, numeric=True),
            Cell(fmt_rate(rate), rate, numeric=True),
            Cell(str(errors), errors, numeric=True),
            Cell(fmt_latency(p50), p50, numeric=True),
            Cell(fmt_latency(p99), p99, numeric=True),
        ]
    return rows


def summary(groups: dict[str, list[dict[str, Any]]], rates: dict[str, float | None]) -> str:
    """One line for the panel title: total rate and latency over every worker."""
    everything = [recent(s) for series in groups.values() for s in series]
    total = rates.get(TOTAL)
    return (
        f"{fmt_rate(total)} req/s  p50 {fmt_latency(quantile(everything, 0.5))}"
        f"  p99 {fmt_latency(quantile(everything, 0.99))}"
    )


def totals(groups: dict[str, list[dict[str, Any]]]) -> dict[str, int]:
    counts = {w: sum(int(s.get("count", 0)) for s in series) for w, series in groups.items()}
    counts[TOTAL] = sum(counts.values())
    return counts
