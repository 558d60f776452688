"""Plain-text rendering of the stats document for `djinn status`.

It must never crash: it is what an operator runs when something is already wrong, and
the document may come from an older or newer appliance, or hold a worker that has not
reported yet. Every field is read with a default, and a missing one prints as "-".
"""

from __future__ import annotations

from typing import Any

STALE_REPORT_S = 2.0  # a live worker's stats older than this are called out


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _secs(value: Any, fmt: str = ".0f") -> str:
    n = _num(value)
    return "-" if n is None else f"{n:{fmt}}s"


def _latency(value: Any) -> str:
    n = _num(value)
    if n is None:
        return "-"
    return f"{n * 1e6:.0f}µs" if n < 1e-3 else f"{n * 1e3:g}ms" if n < 1 else f"{n:g}s"


def _share(value: Any) -> str:
    """A session's share of its worker's recent execution time."""
    n = _num(value)
    return "-" if n is None else f"{n * 100:.0f}%"


def _table(headers: list[str], rows: list[list[Any]]) -> list[str]:
    if not rows:
        return ["(none)"]
    cells = [headers, *[[str(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*headers), fmt.format(*("-" * w for w in widths))]
    return out + [fmt.format(*r) for r in cells[1:]]


def _usage(seg: dict[str, Any]) -> str:
    cap = _num(seg.get("capacity")) or 0
    used, peak = _num(seg.get("used")) or 0, _num(seg.get("peak")) or 0
    pct = f" ({100 * used / cap:.0f}%)" if cap else ""
    return f"{human_bytes(used)} / {human_bytes(cap)}{pct}, peak {human_bytes(peak)}"


def worker_state(w: dict[str, Any]) -> str:
    """What a worker is doing, in the words an operator needs: busy with what, for how
    long; restarting; or silent (its last report is old)."""
    if not w.get("alive", True):
        why = w.get("last_error") or "exited"
        return f"DOWN ({why}), restart in {_secs(w.get('backoff_s'), '.1f')}"
    if not w.get("ready", True):
        return "starting"
    busy = w.get("busy")
    if isinstance(busy, dict):
        return (
            f"busy {_secs(busy.get('for_s'), '.1f')} "
            f"({busy.get('kind', '?')}, session {busy.get('session', '?')})"
        )
    age = _num(w.get("stats_age_s"))
    if age is not None and age > STALE_REPORT_S:
        return f"no report for {age:.1f}s"
    return "idle"


def _utilisation(w: dict[str, Any]) -> str:
    pct = _num(w.get("utilisation"))
    source = w.get("utilisation_source") or ""
    text = "-" if pct is None else f"{pct:.0f}% cpu" if source == "process_cpu" else f"{pct:.0f}%"
    return text + gpu_memory(w)


def gpu_memory(w: dict[str, Any]) -> str:
    """`` 12.3 GiB/139.8 GiB`` of a GPU worker's card as NVML sees it; empty otherwise."""
    used, total = _num(w.get("gpu_memory_used")), _num(w.get("gpu_memory_total"))
    if used is None or not total:
        return ""
    return f" {human_bytes(used)}/{human_bytes(total)}"


def render(doc: dict[str, Any]) -> str:
    app = doc.get("appliance") or {}
    addrs = ", ".join(str(a) for a in (app.get("addresses") or {}).values())
    lines = [f"Djinn appliance pid {app.get('pid', '?')}  up {_secs(app.get('uptime_s'))}  {addrs}"]
    lines += ["", "Workers"]
    lines += _table(
        ["id", "device", "pid", "state", "util", "restarts", "sessions"],
        [
            [
                w.get("id", "?"),
                w.get("device", "?"),
                w.get("pid", "-"),
                worker_state(w),
                _utilisation(w),
                w.get("restarts", 0),
                w.get("sessions", 0),
            ]
            for w in doc.get("workers") or []
        ],
    )
    lines += ["", "Sessions"]
    lines += _table(
        [
            "id",
            "worker",
            "peer",
            "state",
            "phase",
            "class",
            "share",
            "age",
            "last beat",
            "requests",
            "handles",
            "bytes",
        ],
        [
            [
                s.get("id", "?"),
                s.get("worker", "?"),
                s.get("peer", "?"),
                s.get("state", "-"),
                s.get("phase", "-"),
                s.get("class") or "-",
                _share(s.get("exec_share")),
                _secs(s.get("age_s")),
                _secs(s.get("last_heartbeat_s"), ".1f"),
                s.get("requests", "-"),
                s.get("handles", "-"),
                human_bytes(_num(s.get("bytes")) or 0),
            ]
            for s in doc.get("sessions") or []
        ],
    )
    vmu = doc.get("vmu") or {}
    lines += ["", "Memory", f"host arena  {_usage(vmu.get('host_arena') or {})}"]
    for dev in vmu.get("devices") or []:
        for seg in ("text", "data", "stack"):
            lines.append(f"worker {dev.get('worker', '?')} {seg:<5} {_usage(dev.get(seg) or {})}")
    sched = [r for r in doc.get("scheduler") or [] if isinstance(r, dict)]
    if sched:  # issue 10: what each worker's scheduler decided
        lines += ["", "Scheduling"]
        lines += _table(
            [
                "worker",
                "policy",
                "queued",
                "oldest wait",
                "preemptions",
                "longest slice",
                "batches",
                "mean batch",
                "largest",
            ],
            [
                [
                    r.get("worker", "?"),
                    r.get("policy", "-"),
                    r.get("queued", "-"),
                    _latency(r.get("oldest_wait_s")),
                    r.get("preemptions", "-"),
                    _latency(r.get("longest_slice_s")),
                    (r.get("batching") or {}).get("batches", "-"),
                    (r.get("batching") or {}).get("mean", "-"),
                    (r.get("batching") or {}).get("largest", "-"),
                ]
                for r in sched
            ],
        )
    latency = doc.get("latency")
    if isinstance(latency, dict):
        lines += ["", f"Requests (last {_secs(latency.get('window_s'))})"]
        lines += _table(
            ["kind", "count", "errors", "p50", "p90", "p99"],
            [
                [
                    k.get("kind", "?"),
                    k.get("count", 0),
                    k.get("errors", 0),
                    _latency(k.get("p50_s")),
                    _latency(k.get("p90_s")),
                    _latency(k.get("p99_s")),
                ]
                for k in latency.get("kinds") or []
                if k.get("count")
            ],
        )
    lines += ["", f"Models: {len(doc.get('models') or [])} registered"]
    return "\n".join(lines)
