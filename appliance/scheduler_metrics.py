"""Prometheus metrics of each worker's scheduler (issue 10): its queue, slices,
preemptions and decode batches, and each session's share of execution time; read from
the same stats document as ``djinn status --json``."""

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
    batches = CounterMetricFamily(
        "djinn_scheduler_batches",
        "Decode steps of several sessions run as one batched forward, by worker: "
        "batches run, and the steps they served (Note [cross-session batching])",
        labels=["worker", "what"],
    )
    largest = GaugeMetricFamily(
        "djinn_scheduler_largest_batch", "The largest decode batch so far", labels=["worker"]
    )
    share = GaugeMetricFamily(
        "djinn_session_exec_share",
        "A session's share of its worker's recent execution time, with the priority class "
        "of its waiting request ('' when none waits)",
        labels=["worker", "session", "class"],
    )
    tenant_exec = CounterMetricFamily(
        "djinn_tenant_exec_seconds",
        "Execution seconds each tenant has had on a worker since it started (the weights of "
        "scheduler_weights share these out)",
        labels=["worker", "tenant"],
    )
    for row in doc.get("scheduler", []):
        worker, policy = str(row.get("worker")), str(row.get("policy", ""))
        queued.add_metric([worker, policy], row.get("queued", 0))
        oldest.add_metric([worker], row.get("oldest_wait_s", 0.0))
        longest.add_metric([worker], row.get("longest_slice_s", 0.0))
        for event in ("slices", "preemptions", "completed"):
            counts.add_metric([worker, policy, event], row.get(event, 0))
        batching = row.get("batching") or {}
        batches.add_metric([worker, "batches"], batching.get("batches", 0))
        batches.add_metric([worker, "steps"], batching.get("calls", 0))
        largest.add_metric([worker], batching.get("largest", 0))
        for tenant, t in (row.get("tenants") or {}).items():
            tenant_exec.add_metric([worker, str(tenant)], t.get("exec_s", 0.0))
    for s in doc.get("sessions", []):
        if isinstance(s.get("exec_share"), (int, float)):
            labels = [str(s.get("worker")), str(s.get("id")), str(s.get("class", ""))]
            share.add_metric(labels, s["exec_share"])
    yield queued
    yield oldest
    yield longest
    yield counts
    yield batches
    yield largest
    yield share
    yield tenant_exec
