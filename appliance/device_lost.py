"""A worker whose GPU context is lost leaves, so that a fresh one takes its place.

Note [a lost GPU context] (executor/device.py says how it is detected): after a request
failed in a kernel, a worker whose device no longer answers writes the replies it has
queued (the failed request's error first) for at most ``EXIT_FLUSH_S``, then exits with
``control.DEVICE_LOST_EXIT``. The supervisor restarts it as after a crash, and every
session on it gets WORKER_LOST (and is rebuilt from its lineage where the client keeps
it), where staying up would fail each of their requests with the culprit's error.
"""

from __future__ import annotations

import logging
import os
import select
import time
from typing import TYPE_CHECKING

from . import control

if TYPE_CHECKING:
    from .worker import Worker

log = logging.getLogger("djinn.appliance.worker")

EXIT_FLUSH_S = 1.0  # how long a worker whose device is lost writes queued replies


def exit_if_lost(w: Worker) -> None:
    if w.device.healthy():
        return
    log.critical(
        "worker %s: the CUDA context of %s is lost (a kernel's device-side assert or an "
        "illegal address); exiting so that the supervisor starts a fresh one",
        w.id,
        w.device.name,
    )
    deadline = time.monotonic() + EXIT_FLUSH_S
    for s in list(w.sessions.values()):
        while s.outbox and time.monotonic() < deadline:
            try:
                if s.outbox.flush(s.sock):
                    break
                select.select([], [s.sock], [], 0.05)  # a slow reader: wait a little
            except (OSError, ValueError):
                break
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(control.DEVICE_LOST_EXIT)
