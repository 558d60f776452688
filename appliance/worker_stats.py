"""The stats document a worker pushes to its supervisor: its session rows and the rest,
and how they travel (Note [stats in parts])."""

from __future__ import annotations

import errno
import logging
import time
from typing import TYPE_CHECKING, Any

from . import control
from .sessions import OPEN

if TYPE_CHECKING:
    from .worker import Worker

log = logging.getLogger("djinn.appliance.worker")

STATS_PUSH_S = 0.1  # stats freshness when only byte counts changed
STATS_PART_SESSIONS = 200  # session rows per stats datagram (Note [stats in parts])


def push(w: Worker, force: bool = False) -> None:
    now = time.monotonic()
    since = now - w.last_push
    # dirty: at most every STATS_PUSH_S; clean: once a second (ages and heartbeats move)
    if not force and since < (STATS_PUSH_S if w.stats_dirty else 1.0):
        return
    with w.busy.lock:  # Note [busy stats]: the busy thread may push too
        send(w, now)


def send(w: Worker, now: float, serving_thread: bool = True) -> None:
    w.last_push = now
    w.stats_dirty = False
    sessions, msg = build(w, now, serving_thread)
    try:
        # Note [stats in parts]: one datagram holds at most ~200 KB (the socket's send
        # buffer), about 800 sessions' rows. Rows go first in parts of
        # STATS_PART_SESSIONS; the closing "stats" message tells how many to expect.
        parts = range(0, len(sessions), STATS_PART_SESSIONS)
        for i in parts:
            rows = sessions[i : i + STATS_PART_SESSIONS]
            control.send(w.ctl, {"op": "stats_part", "sessions": rows})
        control.send(w.ctl, {**msg, "parts": len(parts)})
    except OSError as exc:
        if exc.errno in (errno.EMSGSIZE, errno.ENOBUFS, errno.EAGAIN):
            log.warning("worker %s: stats not sent (%s)", w.id, exc)  # next push
            return
        w.stopping = True  # the supervisor is gone


def build(w: Worker, now: float, serving_thread: bool) -> tuple[list[dict], dict[str, Any]]:
    """(session rows, the closing "stats" message without its part count)."""
    shares = w.scheduler.session_stats()  # execution share, priority class
    sessions = [
        # device and host tiers, and what the scheduler gave it
        {
            **s.stats(now),
            **w.memory.session_stats(s.id),
            **shares.get(s.id, {"exec_share": 0.0, "exec_s": 0.0, "class": ""}),
        }
        for s in list(w.sessions.values())
        if s.state == OPEN
    ]
    msg = {
        "op": "stats",
        "vmu": w.store.vmu.stats(),
        "arena": w.store.slabs.stats(),
        # only the serving thread moves the window's ring (Note [recent window])
        "requests": w.requests.snapshot(roll=serving_thread),
        "models": [
            {**e.stats(), **w.memory.model_stats(e.fingerprint, e.nbytes)}
            for e in w.models.entries.values()
        ],
        "memory": {**w.memory.stats(), "admission": w.admission.stats(now)},
        "busy": w.busy.describe(now),
        "utilisation": w.utilisation.sample(),
        "device_memory": w.device.memory_figures(),
        "prewarm": w.prewarm.state,
        "scheduler": {
            **w.scheduler.stats(),
            "graph_templates": w.graphs.stats(),
            "graph_plans": w.plans.stats(),  # Note [graph plans]
            "cuda_graphs": w.cuda_graphs.stats(),  # Note [CUDA graphs for plans]
            "batching": w.batcher.stats.as_dict(),
        },
        "adopted": w.adopted,
        "spin": w.spin.stats(),  # Note [spin before sleeping]
    }
    return sessions, msg
