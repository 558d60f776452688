"""Prometheus metrics of each worker's scheduler (issue 10): its queue, slices and
preemptions; read from the same stats document as ``djinn status --json``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


def collect(doc: dict[str, Any]) -> Iterator[Any]:
    queued = GaugeMetricFamily(
        "djinn_scheduler_queued",
        "Requests waiting in or running from the worker's scheduler",
        labels=["worker", "policy"],
    )
    oldest = GaugeMetricFamily(
        "djinn_scheduler_oldest_wait_seconds",
        "How long the oldest request in the scheduler has waited",
        labels=["worker"],
    )
    longest = GaugeMetricFamily(
        "djinn_scheduler_longest_slice_seconds",
        "The longest slice so far (one op holds the worker that long at most)",
        labels=["worker"],
    )
    counts = CounterMetricFamily(
        "djinn_scheduler_events",
        "Scheduler events by worker: slices run, preemptions, requests completed",
        labels=["worker", "policy", "event"],
    )
    for row in doc.get("scheduler", []):
        worker, policy = str(row.get("worker")), str(row.get("policy", ""))
        queued.add_metric([worker, policy], row.get("queued", 0))
        oldest.add_metric([worker], row.get("oldest_wait_s", 0.0))
        longest.add_metric([worker], row.get("longest_slice_s", 0.0))
        for event in ("slices", "preemptions", "completed"):
            counts.add_metric([worker, policy, event], row.get(event, 0))
    yield queued
    yield oldest
    yield longest
    yield counts
