"""Built-in memory policies (entry point group ``djinn.memory_policies``).

``semantic`` (the default) orders victims by what the hints and session activity say;
``lru`` (least recently used, whatever the bytes are) is the comparison it must beat in
``benchmarks/pressure.py``.
"""

from __future__ import annotations

from djinn.semantics.memory import KV_CACHE, TENSORS, WEIGHTS, MemoryView, UnitFacts

# a session whose pause is this many times its usual in-burst gap is between bursts
BETWEEN_BURSTS = 4.0
# a session idle this many times its usual think time is presumed gone
OVERDUE = 2.0


class LruPolicy:
    name = "lru"

    def victims(self, view: MemoryView) -> list[str]:
        return [u.key for u in sorted(view.units, key=lambda u: -u.idle_s)]


class SemanticPolicy:
    """Note [semantic eviction]: the unit whose next use is furthest away goes first, as
    far as the program's semantics say.

    1. KV caches of sessions idle well past their usual think time (the agent or user is
       probably gone), longest idle first;
    2. KV caches of sessions between bursts (thinking), the one with the *most think time
       left* first: LRU evicts the session that paused first, which is the one about to
       come back;
    3. weights of models no call is using, least shared first (one swap-in per session
       using them), then least recently used: keep the most shared;
    4. KV caches of sessions in the middle of a burst (a decode loop): their next step
       is milliseconds away, so they go last, and among them the one that ran *most*
       recently first: the worker serves waiting steps in turn, so the session that just
       had its turn is the one whose next step comes last (LRU picks the next in line
       and thrashes a round-robin of more caches than fit).

    A session's tensors (handles) rank like its KV caches: they are needed again exactly
    when the session next sends a request.
    """

    name = "semantic"

    def victims(self, view: MemoryView) -> list[str]:
        return [u.key for u in sorted(view.units, key=self._rank)]

    @staticmethod
    def _rank(u: UnitFacts) -> tuple:
        if u.kind in (KV_CACHE, TENSORS):
            gap = max(u.burst_gap_s, 1e-3)
            if u.think_s > 0 and u.session_idle_s > OVERDUE * u.think_s:
                return (0, -u.session_idle_s)
            if u.session_idle_s > BETWEEN_BURSTS * gap:
                left = u.think_s - u.session_idle_s if u.think_s > 0 else 0.0
                return (1, -left, -u.session_idle_s)
            return (3, u.session_idle_s)
        if u.kind == WEIGHTS:
            return (2, u.sessions, -u.idle_s)
        return (2, 0, -u.idle_s)
