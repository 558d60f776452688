"""The memory-policy contract (DESIGN.md §10): what leaves device memory under pressure.

A policy only *chooses*. The appliance gives it a read-only view of the facts about
every unit it could move (a registered model's weights, a session's KV cache, a session's
tensors) and asks for victims in order; the mechanism (swapping to the host arena,
restoring a call's working set before it runs, never touching what the running call
needs) lives in the appliance and is correct whichever policy chooses. Policies are
plugins in the entry point group ``djinn.memory_policies``; Djinn instantiates one with
no arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

WEIGHTS = "weights"
KV_CACHE = "kv_cache"
TENSORS = "tensors"  # a session's tensors (handles), one unit per session


@dataclass(frozen=True)
class UnitFacts:
    """One movable unit as the policy sees it. Times are seconds."""

    key: str
    kind: str  # WEIGHTS | KV_CACHE | TENSORS
    bytes: int  # on the device now
    sessions: int  # sessions sharing it (weights: registered users; a session's own: 1)
    idle_s: float  # since a call last used it
    phase: str = "unknown"  # the owning session's last phase hint (KV caches)
    session_idle_s: float = 0.0  # since the owning session's last request ended
    think_s: float = 0.0  # the owner's usual pause between bursts of calls; 0: not known
    burst_gap_s: float = 0.0  # the owner's usual gap between calls inside a burst


@dataclass(frozen=True)
class MemoryView:
    need: int  # bytes the device budget is short of
    device_capacity: int
    device_used: int
    host_free: int  # arena bytes free for swapped-out units
    units: tuple[UnitFacts, ...]  # resident, movable, not needed by the running call


@runtime_checkable
class MemoryPolicy(Protocol):
    name: str

    def victims(self, view: MemoryView) -> list[str]:
        """Keys of ``view.units`` in the order they should leave the device. The
        appliance moves them in that order until ``need`` bytes are free; keys it does
        not know are ignored. Must not raise."""
