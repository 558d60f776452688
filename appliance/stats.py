"""The stats document (DESIGN.md §5): what `djinn status --json`, `Client.stats()` and
`djinn top` show. Built by the supervisor from the workers' latest reports."""

from __future__ import annotations

import os
import time
from typing import Any

from djinn.protocol.frames import VERSION

from .vmu.device import SEGMENTS
from .workers import WorkerHandle

STATS_SCHEMA = 1


def opening_row(session_id: str, peer: str) -> dict:
    """A session's stats row between its hand-over to a worker and that worker's report."""
    return {
        "id": session_id,
        "peer": peer,
        "state": "opening",
        "age_s": 0.0,
        "last_heartbeat_s": 0.0,
        "handles": 0,
        "bytes": 0,
        "arena_leases": 0,
        "requests": 0,
        "phase": "unknown",
        "models": 0,
        "objects": 0,
    }


def build(
    workers: list[WorkerHandle],
    arena: dict[str, Any],
    started: float,
    addresses: dict[str, str],
    supervisor_requests: list[dict[str, Any]] = (),
) -> dict[str, Any]:
    sessions, devices = [], []
    used = peak = 0
    for w in workers:
        st = w.stats
        for s in st.get("sessions", []):
            sessions.append({**s, "worker": w.id})
        share = st.get("arena", {})
        used += share.get("used", 0)
        peak += share.get("peak", 0)
        vmu = st.get("vmu") or {seg: {"capacity": 0, "used": 0, "peak": 0} for seg in SEGMENTS}
        devices.append({"worker": w.id, "device": w.device_name or w.device, **vmu})
    return {
        "schema": STATS_SCHEMA,
        "appliance": {
            "pid": os.getpid(),
            "protocol": VERSION,
            "uptime_s": round(time.time() - started, 3),
            "addresses": addresses,
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
        "requests": [{**r, "worker": w.id} for w in workers for r in w.stats.get("requests", [])]
        + [{**r, "worker": "supervisor"} for r in supervisor_requests],
    }
