"""Prometheus endpoint: the stats document as metrics (optional, ``metrics_port``).

The collector reads the snapshot the supervisor loop refreshes every tick, never the
loop's live state, so the HTTP thread cannot race the loop. Request latency histograms
keep the buckets the workers counted in (``reqstats.BUCKETS``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import CollectorRegistry

from . import memory_metrics, scheduler_metrics
from .reqstats import BUCKETS

log = logging.getLogger("djinn.appliance.metrics")


class StatsCollector:
    def __init__(self, snapshot: Callable[[], dict[str, Any] | None]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Any]:
        doc = self.snapshot()
        if not doc:
            return
        up = GaugeMetricFamily(
            "djinn_worker_up", "1 if the worker is alive and ready", labels=["worker", "device"]
        )
        restarts = CounterMetricFamily(
            "djinn_worker_restarts", "Worker restarts", labels=["worker", "device"]
        )
        for w in doc["workers"]:
            labels = [str(w["id"]), str(w["device"])]
            up.add_metric(labels, 1.0 if w["alive"] and w.get("ready", True) else 0.0)
            restarts.add_metric(labels, w["restarts"])
        yield up
        yield restarts

        # Measured by each worker on this host (appliance/utilisation.py): a GPU's NVML
        # rate, or a CPU worker's process CPU share (source="process_cpu").
        util = GaugeMetricFamily(
            "djinn_worker_utilisation_percent",
            "Device utilisation the worker measured (source: nvml or process_cpu)",
            labels=["worker", "device", "source"],
        )
        busy = GaugeMetricFamily(
            "djinn_worker_busy_seconds",
            "How long the worker's current request has run (0: idle); Note [busy stats]",
            labels=["worker"],
        )
        for w in doc["workers"]:
            if isinstance(w.get("utilisation"), (int, float)):
                source = str(w.get("utilisation_source") or "")
                util.add_metric([str(w["id"]), str(w["device"]), source], w["utilisation"])
            running = w.get("busy") if isinstance(w.get("busy"), dict) else {}
            busy.add_metric([str(w["id"])], float(running.get("for_s", 0.0)))
        yield util
        yield busy

        sessions = GaugeMetricFamily("djinn_sessions", "Open sessions", labels=["worker"])
        per_worker: dict[str, int] = {str(w["id"]): 0 for w in doc["workers"]}
        for s in doc["sessions"]:
            per_worker[str(s["worker"])] = per_worker.get(str(s["worker"]), 0) + 1
        for worker, n in per_worker.items():
            sessions.add_metric([worker], n)
        yield sessions

        arena = doc["vmu"]["host_arena"]
        vmu = GaugeMetricFamily(
            "djinn_vmu_bytes", "VMU memory by segment", labels=["worker", "segment", "measure"]
        )
        for measure in ("capacity", "used", "peak"):
            vmu.add_metric(["host", "host_arena", measure], arena[measure])
        for dev in doc["vmu"]["devices"]:
            for seg in ("text", "data", "stack"):
                for measure in ("capacity", "used", "peak"):
                    vmu.add_metric([str(dev["worker"]), seg, measure], dev[seg][measure])
        yield vmu

        hist = HistogramMetricFamily(
            "djinn_request_seconds",
            "Request latency by kind and outcome",
            labels=["worker", "kind", "outcome"],
        )
        for r in doc.get("requests", []):
            cumulative, buckets = 0, []
            for bound, n in zip((*BUCKETS, float("inf")), r["buckets"], strict=True):
                cumulative += n
                buckets.append((_le(bound), cumulative))
            hist.add_metric([str(r["worker"]), r["kind"], r["outcome"]], buckets, r["sum_s"])
        yield hist
        yield from memory_metrics.collect(doc)  # tiers, swaps, evictions (issue 9 §5)
        yield from scheduler_metrics.collect(doc)  # queue, preemptions (issue 10)


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)


def start(host: str, port: int, snapshot: Callable[[], dict[str, Any] | None]) -> Any:
    """Serve /metrics on host:port in a daemon thread; returns the server."""
    from prometheus_client import start_http_server

    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(snapshot))
    server, _thread = start_http_server(port, addr=host, registry=registry)
    log.info("metrics on http://%s:%d/metrics", host, server.server_port)
    return server
