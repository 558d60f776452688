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

A request's deadline is kept by (session, request id), never by ``id(frame)``: a frame
answered on a path that did not forget its deadline left the entry behind, and a later
frame at the freed object's address inherited that passed deadline and was refused at
once (tests/unit/test_admission_queue.py). A session's end forgets all of its deadlines.

A parked frame keeps its inline payload (the call's input tensors) in worker memory for
as long as it waits, so the stack charge its reception made (Note [receive slabs],
receive.py) waits with it (``held``) and is released only when the request is answered,
expires or its session ends; it was released when the first attempt returned, and up to
``MAX_WAITING`` frames of inline bytes sat in memory that no budget counted.
"""

from __future__ import annotations

import time
from collections.abc import Callable
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
        # (session id, request id) -> (since, deadline)
        self._deadlines: dict[tuple[str, int], tuple[float, float]] = {}
        self._held: dict[tuple[str, int], int] = {}  # payload bytes charged while waiting
        self.release: Callable[[int], None] = lambda n: None  # the stack's (set by the worker)
        self.admitted = 0  # requests that ran after waiting
        self.timed_out = 0

    def park(
        self, s: WorkerSession, frame: Frame, exc: ResourceExhausted, used: int, payload: int = 0
    ) -> bool:
        """Queue ``frame`` (True), or say it cannot wait (False: answer the error now).
        ``payload``: stack bytes its inline payload is charged, held by the queue from
        now on if it waits (the caller no longer releases them)."""
        if frame.kind.name not in ADMITTED_KINDS or self.timeout_s <= 0:
            return False
        if int(getattr(exc, "short", 0)) > used:
            return False  # short by more than everything held: no free lets it in
        now = time.monotonic()
        key = (s.id, frame.request_id)
        since, deadline = self._deadlines.get(key, (now, now + self._wait(frame)))
        if now >= deadline or len(self.queue) >= self.max_waiting:
            self._deadlines.pop(key, None)
            return False
        self._deadlines[key] = (since, deadline)
        if payload:
            self._held[key] = self._held.get(key, 0) + payload
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
            self._deadlines.pop((w.session.id, w.frame.request_id), None)
            self.release(self._held.pop((w.session.id, w.frame.request_id), 0))
        self.timed_out += len(gone)
        return gone

    def ran(self, s: WorkerSession, frame: Frame) -> None:
        """``frame`` was answered (it fit, or failed otherwise): forget its deadline."""
        if self._deadlines.pop((s.id, frame.request_id), None) is not None:
            self.admitted += 1
        self.release(self._held.pop((s.id, frame.request_id), 0))

    def forget(self, session_id: str) -> None:
        self.queue = [w for w in self.queue if w.session.id != session_id]
        for key in [k for k in self._deadlines if k[0] == session_id]:
            del self._deadlines[key]
        for key in [k for k in self._held if k[0] == session_id]:
            self.release(self._held.pop(key))

    def waiting(self, session_id: str) -> bool:
        return any(w.session.id == session_id for w in self.queue)

    def stats(self, now: float) -> dict[str, Any]:
        return {
            "waiting": len(self.queue),
            "oldest_s": round(max((now - w.since for w in self.queue), default=0.0), 3),
            "admitted_after_wait": self.admitted,
            "timed_out": self.timed_out,
            "held_bytes": sum(self._held.values()),
        }
