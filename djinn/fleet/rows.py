"""What the fleet directory knows of one appliance (``Row``), and what placement and
`djinn status --fleet` read of it. Note [pending placements] is in ``directory.py``."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from djinn.semantics.placement import ApplianceFacts

log = logging.getLogger("djinn.fleet.directory")

PENDING_SESSION_S = 3.0
PENDING_MODEL_S = 120.0  # an upload of a large model may take this long to show up

# Appliance states, in the order an operator meets them.
STARTING, UP, STALE, DEAD = "starting", "up", "stale", "dead"


@dataclass
class Row:
    id: str
    node_id: str
    actor: Any
    started: float
    state: str = STARTING
    since: float = field(default_factory=time.time)
    info_ref: Any = None
    info: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    reported: float = 0.0  # time.time() of the last summary
    why: str = ""
    placed: int = 0
    pending: list[tuple[float, str | None]] = field(default_factory=list)

    def set_state(self, state: str, why: str = "") -> None:
        if state != self.state:
            log.warning("appliance %s: %s -> %s %s", self.id, self.state, state, why)
            self.state, self.since, self.why = state, time.time(), why

    def facts(self, now: float) -> ApplianceFacts:
        s = self.summary
        self.pending = [
            (t, fp)
            for t, fp in self.pending
            if now - t < (PENDING_MODEL_S if fp else PENDING_SESSION_S)
            and not (fp and fp in {m["fingerprint"] for m in s.get("models", [])})
        ]
        return ApplianceFacts(
            id=self.id,
            capacity_bytes=int(s.get("capacity_bytes", 0)),
            free_bytes=int(s.get("free_bytes", 0)),
            sessions=int(s.get("sessions", 0)),
            queued=int(s.get("queued", 0)),
            models=frozenset(m["fingerprint"] for m in s.get("models", [])),
            model_bytes=tuple((m["fingerprint"], int(m["bytes"])) for m in s.get("models", [])),
            pending_sessions=sum(1 for t, _ in self.pending if now - t < PENDING_SESSION_S),
            pending_models=frozenset(fp for _, fp in self.pending if fp),
            workers=max(int(s.get("workers", 1)), 1),
        )

    def public(self, now: float) -> dict[str, Any]:
        return {
            "id": self.id,
            "node_id": self.node_id,
            "node_ip": self.info.get("node_ip", ""),
            "endpoint": self.info.get("endpoint", ""),
            "state": self.state,
            "for_s": round(now - self.since, 3),
            "why": self.why,
            "report_age_s": round(now - self.reported, 3) if self.reported else None,
            "placed": self.placed,
            "pending": len(self.pending),
            **self.summary,
        }
