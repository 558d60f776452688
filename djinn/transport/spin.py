"""Waiting on a socket by polling it for a moment before sleeping on it.

Note [spin before sleeping]: a request and its reply are two wake-ups. An end that waits
in a blocking recv or epoll_wait gives up its core, and the other end's send must then
wake it. On the 2-core VM this was measured on, a wake-up cost more than the work of a
small request: a HEARTBEAT took 90-110 µs with both ends sleeping and 32 µs with both
ends polling (a raw 64-byte ping-pong between two sleeping processes: 30 µs), and a
tiny put+get 430 µs against 172 µs. Worker CPU per request fell too: its send no longer
has to wake a sleeping peer.

So an end that expects an answer soon polls its socket without blocking, for up to a
window, before it sleeps: a client after sending a request (``client_spin_us``), a worker
after its replies, for the next request (``worker_spin_us``). Three rules keep the cores
for work:

- it spins only when its last wait *of the same key* (a client: the request's kind) ended
  within the window, measured whether it spun or slept. A client waiting on a long EXEC,
  or a worker whose clients have gone quiet, burns one window, then sleeps at once again
  until a quick answer turns spinning back on;
- each poll that finds nothing yields the core (``sched_yield``), so a spinning end never
  keeps a runnable process that shares its core (the one it waits for, often) off it;
- with a single usable core there is no spinning at all: the other end could only run
  when this one stops.
"""

from __future__ import annotations

import math
import os
import selectors
import time
from collections.abc import Callable, Hashable
from typing import TypeVar

T = TypeVar("T")


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


class Spin:
    """One end's spinning: the window and, per key, whether the last wait was quick."""

    __slots__ = ("_slow", "caught", "spun", "window")

    def __init__(self, window_us: float) -> None:
        self.window = window_us / 1e6 if window_us > 0 and usable_cores() > 1 else 0.0
        self._slow: set[Hashable] = set()  # keys whose last wait outlasted the window
        self.spun = 0  # waits that polled, and those of them that got their answer so
        self.caught = 0

    def poll(
        self, ready: Callable[[], T], key: Hashable = None, limit: float | None = None
    ) -> T | None:
        """``ready()`` (which must not block) until it gives something truthy, or the window
        (or ``limit`` seconds, if shorter) is over: what it gave last. None at once when this
        end does not spin, or the last wait under ``key`` outlasted the window."""
        if not self.window or key in self._slow:
            return None
        end = time.perf_counter() + (self.window if limit is None else min(limit, self.window))
        self.spun += 1
        while True:
            got = ready()
            if got:
                self.caught += 1
                return got
            if time.perf_counter() >= end:
                return got
            os.sched_yield()

    def select(
        self, sel: selectors.BaseSelector, timeout: float
    ) -> list[tuple[selectors.SelectorKey, int]]:
        """``sel``'s ready keys within ``timeout`` seconds, polled for a moment first if
        the last such wait was as short (a worker's loop)."""
        if timeout <= 0 or not self.window:
            return sel.select(timeout)
        t0 = time.perf_counter()
        ready = self.poll(lambda: sel.select(0), limit=timeout)
        if not ready:
            ready = sel.select(max(0.0, timeout - (time.perf_counter() - t0)))
        # nothing within the timeout: no quick answer to expect either
        self.waited(time.perf_counter() - t0 if ready else math.inf)
        return ready

    def stats(self) -> dict[str, float | int]:
        """The window (0: off) and the waits that polled, and how many of them got their
        answer while polling (the rest slept after all)."""
        return {
            "window_us": round(self.window * 1e6, 1),
            "polled": self.spun,
            "answered": self.caught,
        }

    def waited(self, seconds: float, key: Hashable = None) -> None:
        """How long a wait under ``key`` took, spinning or sleeping: it decides the next."""
        if seconds > self.window:
            self._slow.add(key)
        else:
            self._slow.discard(key)
