"""Model uploads in flight, by fingerprint (issue 16 §5).

Note [one upload per fingerprint]: when a session is told to upload a model's weights
(REGISTER answered ``cached: false``), it becomes that fingerprint's *uploader*. Another
session registering the same fingerprint meanwhile is not told to upload too (that held
the weights twice until both were built): its REGISTER is parked, unanswered, and
dispatched again once the uploader is done. By then the model is cached and the waiter
attaches to it; if the uploader gave up (its REGISTER was refused, it moved on to other
requests, its session ended, or ``UPLOAD_WAIT_S`` passed), the first waiter becomes the
uploader instead. The worker is single-threaded: parking costs nothing but the waiter's
reply, and its lease does not run while it waits on us.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from djinn.protocol.frames import Frame

    from .sessions import WorkerSession

UPLOAD_WAIT_S = 300.0  # presumed abandoned by then (under the client's IO_TIMEOUT_S)
# requests an uploader sends while uploading; any other means it gave the upload up
UPLOADING_KINDS = frozenset({"ALLOC", "PUT", "HEARTBEAT", "PING", "REGISTER"})


class Parked:
    """A handler's answer when the request waits: no reply now, dispatched again later."""


PARKED = Parked()


@dataclass
class Upload:
    uploader: str  # session id
    started: float = field(default_factory=time.monotonic)
    waiters: list[tuple[WorkerSession, Frame]] = field(default_factory=list)


class Uploads:
    def __init__(self) -> None:
        self.by_fp: dict[str, Upload] = {}

    def busy(self, fp: str, session_id: str) -> bool:
        """Another session is uploading ``fp``: this one should wait for it."""
        up = self.by_fp.get(fp)
        return up is not None and up.uploader != session_id

    def uploading(self, session_id: str) -> bool:
        return any(up.uploader == session_id for up in self.by_fp.values())

    def begin(self, fp: str, session_id: str) -> None:
        up = self.by_fp.get(fp)
        if up is None:
            self.by_fp[fp] = Upload(session_id)
        else:
            up.uploader, up.started = session_id, time.monotonic()

    def park(self, fp: str, session: WorkerSession, frame: Frame) -> Parked:
        self.by_fp[fp].waiters.append((session, frame))
        return PARKED

    def waiting(self, session_id: str) -> bool:
        return any(s.id == session_id for up in self.by_fp.values() for s, _ in up.waiters)

    def finish(self, fp: str, session_id: str) -> list[tuple[WorkerSession, Frame]]:
        """The uploader of ``fp`` is done, whatever the outcome: its waiters go again."""
        up = self.by_fp.get(fp)
        if up is None or up.uploader != session_id:
            return []
        del self.by_fp[fp]
        return up.waiters

    def abandon(self, session_id: str, now: float | None = None) -> list:
        """Uploads ``session_id`` gave up (or, with ``session_id`` empty, that ran past
        UPLOAD_WAIT_S); a departed waiter is also forgotten. Returns the waiters to
        dispatch again."""
        now = time.monotonic() if now is None else now
        ready = []
        for fp, up in list(self.by_fp.items()):
            up.waiters = [(s, f) for s, f in up.waiters if s.id != session_id]
            if up.uploader == session_id or now - up.started > UPLOAD_WAIT_S:
                del self.by_fp[fp]
                ready.extend(up.waiters)
        return ready
