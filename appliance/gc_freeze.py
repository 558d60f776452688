"""Keep the worker's import-time objects out of the cyclic garbage collector's full passes.

Note [frozen imports]: a worker holds some 400,000 objects the collector tracks once torch,
Djinn and (Note [prewarm]) transformers' shared modules are imported: functions, types,
op overloads, module dictionaries that live as long as the process. A graph's run makes
and drops many small objects (decoded nodes, argument lists), some of which outlive two
young collections and count towards the next full one; every full pass then walks the
import-time objects again, ~0.2 s on a 2-core host, in the middle of some request.
``gc.freeze()`` moves every object tracked at that moment to a generation the collector
never walks. It is done only while nothing a client made exists yet (no session was ever
opened and no model is cached), so what it moves are the worker's own modules and
structures; a frozen object is still freed when its last reference goes, only a cycle
among them would stay. Everything sessions create later is collected as before.
"""

from __future__ import annotations

import gc


class FreezeImports:
    """Freeze once at start, and once more when the background imports are done, if the
    worker is still untouched by then (``pristine()``)."""

    def __init__(self) -> None:
        self.decided = False  # the second freeze was made or ruled out

    def at_ready(self) -> None:
        gc.freeze()

    def after_prewarm(self, prewarm_state: str, pristine: bool) -> None:
        """Called from the serving loop: once the prewarm has finished (done, failed or
        off), freeze if no client state exists yet; either way, never again."""
        if self.decided or prewarm_state in ("pending", "running"):
            return
        self.decided = True
        if pristine:
            gc.freeze()
