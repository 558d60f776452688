"""Stats document -> table rows, for the workers, sessions and models panels.

Pure functions (no widgets) so the mapping can be read and tested on its own. Every key is
read with a default: the document grows over time (models are still an empty list) and
`djinn top` must keep working against an appliance one version older or newer.
"""

from __future__ import annotations

from typing import Any

from djinn.cli.status import gpu_memory, human_bytes

from .table import Cell, Column, Rows

WORKER_COLUMNS = [
    Column("id", "id"),
    Column("device", "device"),
    Column("pid", "pid", numeric=True),
    Column("alive", "alive"),
    Column("restarts", "restarts", numeric=True),
    Column("sessions", "sessions", numeric=True),
    Column("memory", "memory policy, queue"),
    Column("sched", "queued, batch", numeric=True),
    Column("util", "util", numeric=True),
]

SESSION_COLUMNS = [
    Column("id", "id"),
    Column("worker", "worker"),
    Column("peer", "peer"),
    Column("age", "age", numeric=True),
    Column("beat", "last beat", numeric=True),
    Column("handles", "handles", numeric=True),
    Column("bytes", "bytes", numeric=True),
    Column("host", "on host", numeric=True),
    Column("swaps", "swaps in/out", numeric=True),
    Column("phase", "phase"),
    Column("share", "exec share, class", numeric=True),
]

MODEL_COLUMNS = [
    Column("name", "name"),
    Column("fingerprint", "fingerprint"),
    Column("bytes", "bytes", numeric=True),
    Column("host", "on host", numeric=True),
    Column("swaps", "swaps in/out", numeric=True),
    Column("evictions", "evictions", numeric=True),
    Column("users", "users", numeric=True),
    Column("hits", "hits", numeric=True),
]


def fmt_duration(seconds: float | None) -> str:
    """Compact age: 0.4s, 42s, 3m07s, 2h05m. Taken from the document, never the local clock,
    so what is shown is what the appliance measured."""
    if seconds is None:
        return "-"
    if seconds < 10:
        return f"{seconds:.1f}s"
    s = int(seconds)
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _num(value: Any) -> float | None:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _int_cell(value: Any) -> Cell:
    n = _num(value)
    return Cell("-" if n is None else str(n), n, numeric=True)


def _bytes_cell(value: Any) -> Cell:
    n = _num(value)
    return Cell("-" if n is None else human_bytes(n), n, numeric=True)


def _age_cell(value: Any) -> Cell:
    n = _num(value)
    return Cell(fmt_duration(n), n, numeric=True)


def _count(value: Any) -> Any:
    # "users" may come as a count or as the list of session ids using the model.
    return len(value) if isinstance(value, (list, tuple)) else value


def _swaps_cell(row: dict[str, Any]) -> Cell:
    """Swaps in/out between device and host (issue 9 §5), sorted by their sum; KV caches
    rebuilt from their tokens instead follow as ``+N rec`` (Note [kv recompute])."""
    ins, outs = _num(row.get("swaps_in")), _num(row.get("swaps_out"))
    if ins is None and outs is None:
        return Cell("-", None, numeric=True)
    ins, outs = int(ins or 0), int(outs or 0)
    rec = int(_num(row.get("recomputes")) or 0)
    text = f"{ins}/{outs} +{rec} rec" if rec else f"{ins}/{outs}"
    return Cell(text, ins + outs + rec, numeric=True)


def _memory_cell(m: dict[str, Any] | None) -> Cell:
    """The worker's memory policy and its admission queue (Note [admission queue])."""
    if not m:
        return Cell("-")
    queue = m.get("admission") or {}
    waiting = int(_num(queue.get("waiting")) or 0)
    text = f"{m.get('policy', '?')}, {waiting} waiting"
    if waiting:
        text += f" ({_num(queue.get('oldest_s')) or 0:.1f}s)"
    return Cell(text, waiting)


def _sched_cell(row: dict[str, Any] | None) -> Cell:
    """The worker's scheduler queue and its mean decode batch (issue 10 §5)."""
    if not row:
        return Cell("-", None, numeric=True)
    queued = int(_num(row.get("queued")) or 0)
    mean = _num((row.get("batching") or {}).get("mean"))
    return Cell(f"{queued}, {mean:g}" if mean else f"{queued}, -", queued, numeric=True)


def _share_cell(row: dict[str, Any]) -> Cell:
    """A session's share of its worker's recent execution time and the priority class
    of its waiting request (issue 10 §5)."""
    share = _num(row.get("exec_share"))
    if share is None:
        return Cell("-", None, numeric=True)
    text = f"{share * 100:.0f}%"
    if row.get("class"):
        text += f" {row['class']}"
    return Cell(text, share, numeric=True)


def worker_rows(doc: dict[str, Any]) -> Rows:
    rows: Rows = {}
    memory = {str(m.get("worker")): m for m in doc.get("memory", []) if isinstance(m, dict)}
    sched = {str(r.get("worker")): r for r in doc.get("scheduler", []) if isinstance(r, dict)}
    for w in doc.get("workers", []):
        if not w.get("alive", False):
            alive = "NO"
        elif not w.get("ready", True):
            alive = "starting"
        elif isinstance(w.get("busy"), dict):  # Note [busy stats] (appliance/busy.py)
            alive = f"busy {_num(w['busy'].get('for_s')) or 0:.0f}s"
        else:
            alive = "yes"
        # Each worker measures its own device (appliance/utilisation.py): NVML on a GPU;
        # on a CPU worker its process's share of the CPUs, labelled "cpu".
        util = _num(w.get("utilisation"))
        label = " cpu" if w.get("utilisation_source") == "process_cpu" else ""
        rows[str(w.get("id"))] = [
            Cell(str(w.get("id", "?")), w.get("id")),
            Cell(str(w.get("device", "?"))),
            _int_cell(w.get("pid")),
            Cell(alive),
            _int_cell(w.get("restarts")),
            _int_cell(w.get("sessions")),
            _memory_cell(memory.get(str(w.get("id")))),
            _sched_cell(sched.get(str(w.get("id")))),
            # and a GPU's memory as NVML sees it, every process on the card included
            Cell(
                ("-" if util is None else f"{util:.0f}%{label}") + gpu_memory(w), util, numeric=True
            ),
        ]
    return rows


def session_rows(doc: dict[str, Any]) -> Rows:
    rows: Rows = {}
    for s in doc.get("sessions", []):
        sid = str(s.get("id", "?"))
        rows[sid] = [
            Cell(sid),
            Cell(str(s.get("worker", "?")), s.get("worker")),
            Cell(str(s.get("peer", "?"))),
            _age_cell(s.get("age_s")),
            _age_cell(s.get("last_heartbeat_s")),
            _int_cell(s.get("handles")),
            _bytes_cell(s.get("bytes")),
            _bytes_cell(s.get("host_bytes")),
            _swaps_cell(s),
            Cell(str(s.get("phase", "-"))),
            _share_cell(s),
        ]
    return rows


def model_rows(doc: dict[str, Any]) -> Rows:
    rows: Rows = {}
    for i, m in enumerate(doc.get("models", [])):
        fingerprint = str(m.get("fingerprint", ""))
        key = fingerprint or str(m.get("name", "")) or f"#{i}"
        rows[key] = [
            Cell(str(m.get("name", "?"))),
            Cell(fingerprint[:16] or "-"),
            _bytes_cell(m.get("bytes")),
            _bytes_cell(m.get("host_bytes")),
            _swaps_cell(m),
            _int_cell(m.get("evictions")),
            _int_cell(_count(m.get("users", m.get("sessions")))),
            _int_cell(m.get("hits")),
        ]
    return rows


def segments(doc: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """(key, label, {used, peak, capacity}) for the host arena, then each device's
    text / data / stack segments, in document order."""
    vmu = doc.get("vmu", {})
    out = [("host", "host arena", vmu.get("host_arena", {}))]
    for dev in vmu.get("devices", []):
        worker = dev.get("worker", "?")
        for seg in ("text", "data", "stack"):
            out.append((f"w{worker}-{seg}", f"w{worker} {seg}", dev.get(seg, {})))
    return out
