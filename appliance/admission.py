"""The admission queue (issue 9 §2): a call that does not fit even after eviction waits.

Note [admission queue]: when a model call (CALL) or an op graph (EXEC) is short of
device memory after the memory manager evicted all it could, what is left on the device
cannot move (other sessions' tensors, another call's activations). Some of it may be
freed soon, so rather than failing at once the request is parked: unanswered, like a
waiting REGISTER (Note [one upload per fingerprint]), and dispatched again whenever
device memory was freed since its last attempt, until it fits or its deadline passes
(``admission_timeout``, or less if the call asks, ``admission_s``). The queue is bounded
(``MAX_WAITING``); a request that cannot wait gets RESOURCE_EXHAUSTED at once, saying by
how many bytes it was short. Handlers leave nothing half-done on an error, so running a
parked request again is the same as running it for the first time. A request larger
than the whole device never waits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from djinn.errors import ResourceExhausted

if TYPE_CHECKING:
    from djinn.protocol.frames import Frame

    from .sessions import WorkerSession

ADMITTED_KINDS = frozenset({"CALL", "EXEC"})  # requests with no receive slabs to keep
MAX_WAITING = 64


@dataclass
class Waiting:
    session: WorkerSession
    frame: Frame
    since: float
    deadline: float
    used_then: int  # device bytes in use at the last attempt
    message: str
    short: int  # bytes it was short by


class AdmissionQueue:
    def __init__(self, timeout_s: float, max_waiting: int = MAX_WAITING) -> None:
        self.timeout_s = timeout_s
        self.max_waiting = max_waiting
        self.queue: list[Waiting] = []
        self._deadlines: dict[int, tuple[float, float]] = {}  # id(frame) -> (since, deadline)
        self.admitted = 0  # requests that ran after waiting
        self.timed_out = 0

    def park(self, s: WorkerSession, frame: Frame, exc: ResourceExhausted, used: int) -> bool:
        """Queue ``frame`` (True), or say it cannot wait (False: answer the error now)."""
        if frame.kind.name not in ADMITTED_KINDS or self.timeout_s <= 0:
            return False
        now = time.monotonic()
        since, deadline = self._deadlines.get(id(frame), (now, now + self._wait(frame)))
        if now >= deadline or len(self.queue) >= self.max_waiting:
            self._deadlines.pop(id(frame), None)
            return False
        self._deadlines[id(frame)] = (since, deadline)
        short = int(getattr(exc, "short", 0))
        self.queue.append(Waiting(s, frame, since, deadline, used, exc.message, short))
        return True

    def _wait(self, frame: Frame) -> float:
        asked = frame.body.get("admission_s")
        if isinstance(asked, (int, float)) and not isinstance(asked, bool) and asked >= 0:
            return min(float(asked), self.timeout_s)
        return self.timeout_s

    def ready(self, used_now: int) -> list[Waiting]:
        """Requests to try again: device memory was freed since their last attempt."""
        go = [w for w in self.queue if used_now < w.used_then]
        self.queue = [w for w in self.queue if w not in go]
        return go

    def expired(self, now: float) -> list[Waiting]:
        gone = [w for w in self.queue if now >= w.deadline]
        self.queue = [w for w in self.queue if w not in gone]
        for w in gone:
            self._deadlines.pop(id(w.frame), None)
        self.timed_out += len(gone)
        return gone

    def ran(self, frame: Frame) -> None:
        """``frame`` was answered (it fit, or failed otherwise): forget its deadline."""
        if self._deadlines.pop(id(frame), None) is not None:
            self.admitted += 1

    def forget(self, session_id: str) -> None:
        for w in [w for w in self.queue if w.session.id == session_id]:
            self.queue.remove(w)
            self._deadlines.pop(id(w.frame), None)

    def waiting(self, session_id: str) -> bool:
        return any(w.session.id == session_id for w in self.queue)

    def stats(self, now: float) -> dict[str, Any]:
        return {
            "waiting": len(self.queue),
            "oldest_s": round(max((now - w.since for w in self.queue), default=0.0), 3),
            "admitted_after_wait": self.admitted,
            "timed_out": self.timed_out,
        }
