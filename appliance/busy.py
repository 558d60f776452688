"""Stats while the worker is busy (issue 16 §1).

Note [busy stats]: the worker serves from one thread, and a request that runs for
seconds (a long op graph, a model load) used to stop its stats pushes for that long: the
stats document said nothing was happening, sessions that arrived meanwhile showed age 0,
and the promise that the document is at most 0.1 s old was broken exactly when an
operator looks. The worker therefore records which request it is running (a tuple
assignment per request, nothing more) and a daemon thread, waking every
STATS_PUSH_S, pushes the stats itself once that request has run longer than that. The
push says ``busy`` (session, request kind, seconds so far), so the document tells the
operator what the worker is doing and why other sessions' heartbeats look old (the
worker cannot read them until the request ends; Note [busy worker] keeps their leases).

The thread only reads worker state. Building the message may race the serving thread
(a dict that changes size while being read): that push is skipped and the next one,
0.1 s later, tries again. Pushes from both threads take one lock, so the parts of one
stats message never interleave with another's on the control channel.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("djinn.appliance.busy")


class BusyTracker:
    def __init__(self, period_s: float, push: Callable[[], None]) -> None:
        self.period_s = period_s
        self.current: tuple[str, str, float] | None = None  # (session, kind, started)
        self.lock = threading.Lock()  # one stats message on the control channel at a time
        self._push = push
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="djinn-busy-stats", daemon=True)
        self._failures = 0  # logged in full once, then counted: no log line every 0.1 s

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def describe(self, now: float) -> dict[str, Any] | None:
        current = self.current  # one read: the serving thread may replace it meanwhile
        if current is None:
            return None
        session, kind, started = current
        return {"session": session, "kind": kind, "for_s": round(now - started, 3)}

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            current = self.current
            if current is None or time.monotonic() - current[2] < self.period_s:
                continue
            if not self.lock.acquire(blocking=False):
                continue  # the serving thread is pushing right now
            try:
                self._push()
            except RuntimeError:  # a dict changed size under us: the next tick retries
                pass
            except Exception:  # never let a stats push take the worker down
                self._failures += 1
                if self._failures == 1:
                    log.exception("stats push while busy failed (logged once)")
            finally:
                self.lock.release()
