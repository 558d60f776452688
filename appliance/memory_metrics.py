"""Prometheus metrics of the memory manager (issue 9 §5): bytes in each tier and the
swaps, evictions and recomputes behind them, per worker, per model and per session;
read from the same stats document as ``djinn status --json`` and ``djinn top``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

EVENTS = ("swaps_in", "swaps_out", "evictions", "recomputes")


def collect(doc: dict[str, Any]) -> Iterator[Any]:
    events = CounterMetricFamily(
        "djinn_memory_events",
        "Memory manager events by worker and kind (swaps_in, swaps_out, evictions, recomputes)",
        labels=["worker", "policy", "event"],
    )
    moved = CounterMetricFamily(
        "djinn_memory_moved_bytes",
        "Bytes moved between the device and the host tier",
        labels=["worker", "direction"],
    )
    host = GaugeMetricFamily(
        "djinn_memory_host_bytes", "Bytes swapped out to the host tier now", labels=["worker"]
    )
    for m in doc.get("memory", []):
        worker, policy = str(m.get("worker")), str(m.get("policy", "off"))
        for event in EVENTS:
            events.add_metric([worker, policy, event], m.get(event, 0))
        moved.add_metric([worker, "in"], m.get("bytes_in", 0))
        moved.add_metric([worker, "out"], m.get("bytes_out", 0))
        host.add_metric([worker], m.get("host_bytes", 0))
    yield events
    yield moved
    yield host

    model_bytes = GaugeMetricFamily(
        "djinn_model_bytes",
        "A registered model's weights by tier",
        labels=["worker", "model", "name", "tier"],
    )
    model_events = CounterMetricFamily(
        "djinn_model_memory_events",
        "A registered model's swaps and evictions",
        labels=["worker", "model", "event"],
    )
    for m in doc.get("models", []):
        labels = [str(m.get("worker")), str(m.get("fingerprint")), str(m.get("name"))]
        model_bytes.add_metric([*labels, "device"], m.get("device_bytes", m.get("bytes", 0)))
        model_bytes.add_metric([*labels, "host"], m.get("host_bytes", 0))
        for event in EVENTS:
            model_events.add_metric([*labels[:2], event], m.get(event, 0))
    yield model_bytes
    yield model_events

    session_bytes = GaugeMetricFamily(
        "djinn_session_bytes",
        "A session's bytes by tier (device: tensors and resident KV caches)",
        labels=["worker", "session", "tier"],
    )
    session_events = CounterMetricFamily(
        "djinn_session_memory_events",
        "Swaps and evictions of a session's KV caches",
        labels=["worker", "session", "event"],
    )
    for s in doc.get("sessions", []):
        labels = [str(s.get("worker")), str(s.get("id"))]
        session_bytes.add_metric([*labels, "device"], s.get("bytes", 0))
        session_bytes.add_metric([*labels, "host"], s.get("host_bytes", 0))
        for event in EVENTS:
            session_events.add_metric([*labels, event], s.get(event, 0))
    yield session_bytes
    yield session_events
