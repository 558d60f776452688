"""Plain-text rendering of the stats document for `djinn status`."""

from __future__ import annotations

from typing import Any


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def _table(headers: list[str], rows: list[list[Any]]) -> list[str]:
    cells = [headers, *[[str(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*headers), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*r) for r in cells[1:]]
    return out or ["(none)"]


def _usage(seg: dict[str, int]) -> str:
    cap = seg.get("capacity", 0)
    pct = f" ({100 * seg.get('used', 0) / cap:.0f}%)" if cap else ""
    return (
        f"{human_bytes(seg.get('used', 0))} / {human_bytes(cap)}{pct}, "
        f"peak {human_bytes(seg.get('peak', 0))}"
    )


def render(doc: dict[str, Any]) -> str:
    app = doc["appliance"]
    addrs = ", ".join(app.get("addresses", {}).values())
    lines = [f"Djinn appliance pid {app['pid']}  up {app['uptime_s']:.0f}s  {addrs}", ""]
    lines.append("Workers")
    lines += _table(
        ["id", "device", "pid", "alive", "restarts", "sessions"],
        [
            [
                w["id"],
                w["device"],
                w["pid"],
                "yes" if w["alive"] else "NO",
                w["restarts"],
                w["sessions"],
            ]
            for w in doc["workers"]
        ],
    )
    lines += ["", "Sessions"]
    if doc["sessions"]:
        lines += _table(
            ["id", "worker", "peer", "age", "last beat", "handles", "bytes"],
            [
                [
                    s["id"],
                    s["worker"],
                    s["peer"],
                    f"{s['age_s']:.0f}s",
                    f"{s['last_heartbeat_s']:.1f}s",
                    s["handles"],
                    human_bytes(s["bytes"]),
                ]
                for s in doc["sessions"]
            ],
        )
    else:
        lines.append("(none)")
    vmu = doc["vmu"]
    lines += ["", "Memory", f"host arena  {_usage(vmu['host_arena'])}"]
    for dev in vmu["devices"]:
        for seg in ("text", "data", "stack"):
            lines.append(f"worker {dev['worker']} {seg:<5} {_usage(dev[seg])}")
    lines += ["", f"Models: {len(doc.get('models', []))} registered"]
    return "\n".join(lines)
