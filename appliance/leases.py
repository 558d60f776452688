"""The worker's lease sweep: sessions whose client stopped reading or went silent end;
those waiting on the worker itself (a scheduled request, an admission, another session's
upload) are not held to their lease meanwhile."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from .sessions import CLOSED, EXPIRED, OPEN

if TYPE_CHECKING:
    from .worker import Worker

log = logging.getLogger("djinn.appliance.worker")

SWEEP_S = 0.01  # the lease sweep runs at most this often (leases are seconds long)


def sweep(w: Worker) -> None:
    now = time.monotonic()
    if now < w.sweep_due:
        return  # every SWEEP_S: it looks at every session, and leases last seconds
    w.sweep_due = now + SWEEP_S
    if w.uploads.by_fp:
        w.requeue(w.uploads.abandon("", now))  # past UPLOAD_WAIT_S
    for s in list(w.sessions.values()):
        if s.outbox.stalled(now):
            log.info("session %s: stopped reading its reply; closing it", s.id)
            w.end_session(s, CLOSED)
            continue
        if s.outbox:
            continue  # the client is reading a reply: it cannot heartbeat meanwhile
        if w.scheduler.has(s):
            s.touch()  # its request waits for the device: we are not reading it
            continue
        if w.admission.waiting(s.id) or (w.uploads.by_fp and w.uploads.waiting(s.id)):
            s.touch()  # it waits on another session's upload, not dead
            continue
        if s.state == OPEN and now - w.busy_until > s.lease_s and s.expired(now):
            log.info("session %s: lease expired after %.1fs", s.id, now - s.last_seen)
            w.end_session(s, EXPIRED)
