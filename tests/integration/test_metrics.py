"""The Prometheus endpoint is scraped and its values move with the traffic."""

from __future__ import annotations

import re
import socket
import urllib.request

import pytest
import torch

from djinn.errors import NotFound
from tests.conftest import wait_for


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.read().decode()


def _value(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_metrics_endpoint_reports_requests_memory_sessions_and_workers(fresh_appliance):
    port = _free_port()
    app = fresh_appliance(metrics_port=port)
    url = re.search(r"metrics=(\S+)", app.readiness).group(1)
    url = f"http://{url}"
    before = _scrape(url)
    assert _value(before, "djinn_worker_up", worker="0") == 1.0
    assert _value(before, "djinn_vmu_bytes", segment="host_arena", measure="capacity") > 0
    puts_before = _value(before, "djinn_request_seconds_count", kind="PUT", outcome="ok")

    with app.connect() as client, client.session() as s:
        keep = [s.put(torch.randn(512, 512)) for _ in range(5)]
        for r in keep:
            r.cpu()
        with pytest.raises(NotFound):
            s.free(["no-such-handle"])

        def moved():
            text = _scrape(url)
            return (
                _value(text, "djinn_request_seconds_count", kind="PUT", outcome="ok")
                >= puts_before + 5
                and _value(text, "djinn_sessions", worker="0") == 1
                and _value(text, "djinn_vmu_bytes", segment="host_arena", measure="used") > 0
                and _value(text, "djinn_request_seconds_count", kind="FREE", outcome="NOT_FOUND")
                and text
            )

        text = wait_for(moved, timeout=5)
        assert _value(text, "djinn_request_seconds_count", kind="FREE", outcome="NOT_FOUND") == 1
        assert (
            _value(text, "djinn_request_seconds_bucket", kind="GET", outcome="ok", le="+Inf") >= 5
        )
        assert (
            _value(
                text,
                "djinn_request_seconds_count",
                worker="supervisor",
                kind="SESSION_OPEN",
                outcome="ok",
            )
            >= 1
        )
        assert (
            _value(text, "djinn_vmu_bytes", worker="0", segment="data", measure="used")
            >= 5 * 512 * 512 * 4
        )
        del keep
    text = wait_for(lambda: _value(t := _scrape(url), "djinn_sessions", worker="0") == 0 and t)
    assert _value(text, "djinn_worker_restarts_total", worker="0") == 0
    # issue 16 §7: the worker's own measure, labelled with what it measures
    # (a CPU worker's first figure needs a second of samples)
    text = wait_for(lambda: "djinn_worker_utilisation_percent{" in (t := _scrape(url)) and t)
    line = next(x for x in text.splitlines() if x.startswith("djinn_worker_utilisation_percent{"))
    assert 'device="cpu:0' in line and 'source="process_cpu"' in line
    # idle: 0 (a heartbeat may be in flight at any one scrape)
    assert wait_for(lambda: _value(_scrape(url), "djinn_worker_busy_seconds", worker="0") == 0.0)
    # issue 10: what the scheduler did (every request above went through it)
    completed = _value(
        text, "djinn_scheduler_events_total", worker="0", policy="semantic", event="completed"
    )
    assert completed >= 10
    # nothing waits once idle (a heartbeat may be queued at any one scrape)
    assert wait_for(
        lambda: _value(_scrape(url), "djinn_scheduler_queued", worker="0", policy="semantic") == 0
    )
