"""The stats document a worker pushes to its supervisor: its session rows and the rest
(Note [stats in parts] in worker.py says how they travel)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .sessions import OPEN

if TYPE_CHECKING:
    from .worker import Worker


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
            "batching": w.batcher.stats.as_dict(),
        },
        "adopted": w.adopted,
    }
    return sessions, msg
