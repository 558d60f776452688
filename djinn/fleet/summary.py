"""An appliance's stats document reduced to what the fleet directory keeps of it.

Each appliance actor sends this, not the whole document, to the directory: placement
needs free memory, load and resident models; ``djinn status --fleet`` shows the same.
Pure functions: no ray, no sockets.
"""

from __future__ import annotations

from typing import Any


def summarize(doc: dict[str, Any]) -> dict[str, Any]:
    devices = doc.get("vmu", {}).get("devices", [])
    capacity = sum(int(d.get("capacity", 0)) for d in devices)
    used = sum(int(d.get("used", 0)) for d in devices)
    workers = doc.get("workers", [])
    models: dict[str, dict[str, Any]] = {}
    for m in doc.get("models", []):
        fp = str(m.get("fingerprint", ""))[:12]
        row = models.setdefault(
            fp,
            {"fingerprint": fp, "name": m.get("name", ""), "bytes": 0, "sessions": 0},
        )
        # a model on two workers of one appliance holds two copies: both count
        row["bytes"] += int(m.get("bytes", 0))
        row["sessions"] += int(m.get("sessions", 0))
    every = doc.get("latency", {}).get("all", {})
    return {
        "workers": len(workers),
        "workers_up": sum(1 for w in workers if w.get("alive") and w.get("ready")),
        "devices": [str(w.get("device", "")) for w in workers],
        "capacity_bytes": capacity,
        "used_bytes": used,
        "free_bytes": max(capacity - used, 0),
        "sessions": len(doc.get("sessions", [])),
        "queued": sum(int(s.get("queued", 0)) for s in doc.get("scheduler", [])),
        "models": sorted(models.values(), key=lambda r: r["fingerprint"]),
        "requests": int(every.get("count", 0)),
        "p50_s": every.get("p50_s"),
        "p99_s": every.get("p99_s"),
        "uptime_s": doc.get("appliance", {}).get("uptime_s", 0.0),
    }
