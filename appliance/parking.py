"""Requests parked in the admission queue (Note [admission queue] in admission.py), from
the worker's side: trying them again, answering those whose wait is over, and keeping
their sessions out of the worker's selector meanwhile."""

from __future__ import annotations

import selectors
import time
from typing import TYPE_CHECKING

from djinn.errors import ResourceExhausted

from .sessions import OPEN, WorkerSession

if TYPE_CHECKING:
    from .worker import Worker


def admit(w: Worker) -> None:
    """Answer the requests whose deadline passed, and try again those that memory freed
    since their last attempt may let in."""
    now = time.monotonic()
    for waiting in w.admission.expired(now):
        unmute(w, waiting.session)
        w.send_error(
            waiting.session,
            waiting.frame.request_id,
            ResourceExhausted(
                f"waited {now - waiting.since:.1f} s in the admission queue and is still "
                f"short by {waiting.short} bytes: {waiting.message}"
            ),
        )
        waiting.session.failed(waiting.frame.kind.name, waiting.frame.request_id)
        w._serve_buffered(waiting.session)
    for waiting in w.admission.ready(w.store.vmu.used):
        s = waiting.session
        unmute(w, s)
        if s.state == OPEN and s.sock.fileno() >= 0:
            w.dispatch(s, waiting.frame)  # parks (and mutes) it again if short
            w._serve_buffered(s)


def mute(w: Worker, s: WorkerSession) -> None:
    """A session with a request parked in the admission queue is not read (``serve``):
    its socket, readable while a request its client sent behind waits there, leaves the
    selector, or the loop would wake on it at once, again and again (a review saw a
    worker spin a whole core until the request ran)."""
    if not s.muted and s.sock.fileno() >= 0:
        w.sel.unregister(s.sock)
        s.muted = True


def unmute(w: Worker, s: WorkerSession) -> None:
    if s.muted:
        s.muted = False
        if s.sock.fileno() >= 0:
            w.sel.register(s.sock, selectors.EVENT_READ, s)
