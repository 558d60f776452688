"""The placement-policy contract (DESIGN.md §10): which appliance of a fleet gets a session.

A fleet (``djinn fleet``, issue 13) is several appliances behind one directory. When a
client opens a session, the directory hands a policy a read-only view of every live
appliance (its free device memory, its load, the models resident on it) and of the model
the session is about to register, if it said; the policy names an appliance. Starting
appliances, connecting the session and noticing dead nodes are the fleet's, correct
whichever policy chooses. Policies are plugins in the entry point group
``djinn.placement``; Djinn instantiates one with no arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class ApplianceFacts:
    """One live appliance as the policy sees it. Bytes are device memory summed over the
    appliance's workers; ``pending_*`` are placements made but not yet visible in the
    appliance's last report (Note [pending placements], djinn/fleet/directory.py)."""

    id: str
    capacity_bytes: int
    free_bytes: int
    sessions: int  # open sessions in its last report
    queued: int  # requests waiting in its workers' schedulers
    models: frozenset[str]  # fingerprint prefixes resident (device or host tier)
    model_bytes: tuple[tuple[str, int], ...] = ()  # (fingerprint prefix, bytes) resident
    pending_sessions: int = 0
    pending_models: frozenset[str] = frozenset()
    workers: int = 1

    @property
    def load(self) -> int:
        return self.sessions + self.pending_sessions + self.queued


@dataclass(frozen=True)
class PlacementView:
    appliances: tuple[ApplianceFacts, ...]  # live ones only; never empty
    model: str | None  # fingerprint prefix the session registers first, if known
    model_bytes: int  # its size if some appliance holds it (else 0: not known yet)
    sequence: int  # placements the directory made before this one (round robin's turn)


@runtime_checkable
class PlacementPolicy(Protocol):
    name: str

    def choose(self, view: PlacementView) -> str:
        """The id of the appliance that gets the session. Must not raise; an id not in
        ``view.appliances`` is ignored (the directory then uses the first one)."""
