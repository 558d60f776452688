"""Request statistics: totals since start for Prometheus, a recent window for
percentiles (Note [recent window], issue 16 §8)."""

from __future__ import annotations

from djinn.appliance import stats
from djinn.appliance.reqstats import RequestStats, percentiles


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _by_outcome(rs: RequestStats) -> dict[str, dict]:
    return {s["outcome"]: s for s in rs.snapshot()}


def test_slow_requests_long_ago_leave_the_recent_percentiles_but_not_the_totals():
    clock = Clock()
    rs = RequestStats(window_s=60.0, clock=clock)
    for _ in range(100):
        rs.record("EXEC", "ok", 2.0)  # a bad spell
    clock.now += 30
    assert percentiles(rs.snapshot())["p99_s"] == 2.5  # still inside the window
    for _ in range(120):  # two minutes of fast requests, one a second
        clock.now += 1
        rs.record("EXEC", "ok", 0.0001)
    series = _by_outcome(rs)["ok"]
    assert series["count"] == 220  # Prometheus still sees everything
    assert series["recent"]["count"] <= 65  # about a minute's worth, nothing from the spell
    assert 60 <= series["recent"]["recent_s"] <= 60 + 60 / 12 + 1
    assert percentiles(rs.snapshot())["p99_s"] == 1e-4


def test_before_a_full_window_recent_is_everything_since_start():
    clock = Clock()
    rs = RequestStats(window_s=60.0, clock=clock)
    rs.record("PUT", "ok", 0.001)
    clock.now += 10
    rs.record("PUT", "RESOURCE_EXHAUSTED", 0.002)
    snap = _by_outcome(rs)
    assert snap["ok"]["recent"]["count"] == 1 and snap["ok"]["recent"]["recent_s"] == 10
    p = percentiles(rs.snapshot())
    assert (p["count"], p["errors"]) == (2, 1)


def test_a_quiet_window_has_no_percentiles():
    clock = Clock()
    rs = RequestStats(window_s=10.0, clock=clock)
    rs.record("GET", "ok", 0.01)
    for _ in range(30):
        clock.now += 1
        rs.snapshot()
    p = percentiles(rs.snapshot())
    assert p["count"] == 0 and p["p50_s"] is None


def test_the_stats_document_carries_windowed_latency_by_kind():
    clock = Clock()
    rs = RequestStats(window_s=60.0, clock=clock)
    rs.record("EXEC", "ok", 0.2)
    rs.record("HEARTBEAT", "ok", 0.00004)
    doc = stats.latency([{**r, "worker": 0} for r in rs.snapshot()], 60.0)
    kinds = {k["kind"]: k for k in doc["kinds"]}
    assert doc["window_s"] == 60.0 and doc["all"]["count"] == 2
    assert kinds["EXEC"]["p50_s"] == 0.25 and kinds["HEARTBEAT"]["p99_s"] == 5e-5
