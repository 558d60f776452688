"""The stats document (DESIGN.md §5): what `djinn status --json`, `Client.stats()` and
`djinn top` show. Built by the supervisor from the workers' latest reports."""

from __future__ import annotations

import os
import time
from typing import Any

from djinn.protocol.frames import VERSION

from .reqstats import percentiles
from .vmu.device import SEGMENTS
from .workers import WorkerHandle

STATS_SCHEMA = 1


def opening_row(session_id: str, peer: str, age_s: float = 0.0) -> dict:
    """A session's stats row between its hand-over to a worker and that worker's report
    (which waits for the request a busy worker is running: Note [busy stats])."""
    return {
        "id": session_id,
        "peer": peer,
        "state": "opening",
        "age_s": round(age_s, 3),
        "last_heartbeat_s": 0.0,
        "handles": 0,
        "bytes": 0,
        "arena_leases": 0,
        "requests": 0,
        "phase": "unknown",
        "models": 0,
        "objects": 0,
        "tenant": "",  # known once its worker reports it
        "exec_share": 0.0,
        "exec_s": 0.0,
        "class": "",
    }


def build(
    workers: list[WorkerHandle],
    arena: dict[str, Any],
    started: float,
    addresses: dict[str, str],
    supervisor_requests: list[dict[str, Any]] = (),
    window_s: float = 60.0,
) -> dict[str, Any]:
    sessions, devices = [], []
    used = peak = 0
    now = time.monotonic()
    for w in workers:
        st = w.stats
        for s in st.get("sessions", []):
            sessions.append({**s, "worker": w.id})
        reported = {s.get("id") for s in st.get("sessions", [])}
        for sid, (_, peer, since) in list(w.opening.items()):
            if sid not in reported:
                sessions.append({**opening_row(sid, peer, now - since), "worker": w.id})
        share = st.get("arena", {})
        used += share.get("used", 0)
        peak += share.get("peak", 0)
        vmu = st.get("vmu") or {seg: {"capacity": 0, "used": 0, "peak": 0} for seg in SEGMENTS}
        devices.append({"worker": w.id, "device": w.device_name or w.device, **vmu})
    requests = [{**r, "worker": w.id} for w in workers for r in w.stats.get("requests", [])]
    requests += [{**r, "worker": "supervisor"} for r in supervisor_requests]
    return {
        "schema": STATS_SCHEMA,
        "appliance": {
            "pid": os.getpid(),
            "protocol": VERSION,
            "uptime_s": round(time.time() - started, 3),
            "addresses": addresses,
            "stats_window_s": window_s,
        },
        "workers": [w.describe() for w in workers],
        "sessions": sessions,
        "vmu": {
            "host_arena": {
                "name": arena["name"],
                "capacity": arena["size"],
                "used": used,
                "peak": peak,
                "pinned": arena.get("pinned", False),
            },
            "devices": devices,
        },
        "models": [{**m, "worker": w.id} for w in workers for m in w.stats.get("models", [])],
        # per worker: memory policy, bytes in the host tier, swaps, evictions (issue 9 §5)
        "memory": [{**w.stats.get("memory", {}), "worker": w.id} for w in workers],
        # per worker: scheduling policy, queue, slices and preemptions (issue 10)
        "scheduler": [{**w.stats.get("scheduler", {}), "worker": w.id} for w in workers],
        "requests": requests,
        "latency": latency(requests, window_s),
    }


def latency(requests: list[dict[str, Any]], window_s: float) -> dict[str, Any]:
    """Request percentiles over the recent window (Note [recent window], reqstats.py), by
    kind and over everything: what `djinn status` shows and what an alert should read."""
    kinds: dict[str, list[dict[str, Any]]] = {}
    for r in requests:
        kinds.setdefault(r["kind"], []).append(r)
    return {
        "window_s": window_s,
        "all": percentiles(requests),
        "kinds": [{"kind": k, **percentiles(series)} for k, series in sorted(kinds.items())],
    }
