"""Worker-side sessions: the handles, storages and arena slabs a client owns.

A session is pinned to one worker and lives on the connection the supervisor handed
over. It ends in one of three ways, and each frees everything it holds:
closed by the client, its connection dropped (the client died), its lease ran out
(no request or heartbeat for ``interval * misses`` seconds), or an operator ended it
(KILL_SESSION). An expired or ended session keeps a tombstone on its connection so later
calls get SESSION_EXPIRED or SESSION_ENDED instead of a fresh, empty session.
"""

from __future__ import annotations

import secrets
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from djinn.errors import InvalidArgument, NotFound
from djinn.transport.framing import FrameReader

from .outbox import Outbox

OPEN, EXPIRED, CLOSED, ENDED = "open", "expired", "closed", "ended"


@dataclass
class StorageRef:
    """One block of memory held by a session, shared by every handle that views it."""

    nbytes: int
    refs: int = 0
    slab: int | None = None  # arena offset when the bytes live in the host arena
    host: bool = False  # staged weights: charged to the arena only, not the device budget
    away: Any = None  # its HostCopy while swapped out (Note [session tensors on the host])


@dataclass
class WorkerSession:
    id: str
    peer: str
    sock: socket.socket
    reader: FrameReader
    via_unix: bool
    lease_s: float
    created: float = field(default_factory=time.time)
    last_seen: float = field(default_factory=time.monotonic)
    state: str = OPEN
    handles: dict[str, tuple[torch.Tensor, int]] = field(default_factory=dict)
    storages: dict[int, StorageRef] = field(default_factory=dict)
    leases: dict[int, int] = field(default_factory=dict)  # slab offset -> bytes leased
    pending_release: list[int] = field(default_factory=list)
    # receive slabs of the frame being read, by segment: Note [receive slabs] (worker.py)
    frame_slabs: dict[int, int] = field(default_factory=dict)
    frame_private: int = 0  # inline payload bytes of that frame, charged to the stack
    objects: dict[str, Any] = field(default_factory=dict)  # remote objects (KV caches...)
    object_ids: dict[int, str] = field(default_factory=dict)
    models: set[str] = field(default_factory=set)  # fingerprints this session registered
    tenant: str = ""  # whose it is, for fair shares: uid:N, host:ADDR or token:NAME
    object_bytes: int = 0  # tensor bytes held by remote objects (KV caches), in data
    data_bytes: int = 0
    staged_bytes: int = 0  # staged upload bytes it holds, not charged to the device
    requests: int = 0
    phase: str = "unknown"
    end_reason: str = ""  # ENDED: who ended the session and when, told to its client
    outbox: Outbox = field(default_factory=Outbox)  # Note [slow readers] (outbox.py)

    def touch(self) -> None:
        self.last_seen = time.monotonic()

    def expired(self, now: float) -> bool:
        return self.state == OPEN and now - self.last_seen > self.lease_s

    def tensor(self, handle: str) -> torch.Tensor:
        try:
            return self.handles[handle][0]
        except (KeyError, TypeError):
            raise NotFound(f"no handle {handle!r} in this session") from None

    def check_lease(self, off: int, nbytes: int) -> None:
        """A PUT may only name a slab this session ALLOCated and that is big enough."""
        leased = self.leases.get(off) if type(off) is int else None
        if leased is None:
            raise NotFound(f"slab {off!r} is not leased to this session (ALLOC it first)")
        if nbytes > leased:
            raise InvalidArgument(f"tensor of {nbytes} bytes does not fit its {leased}-byte slab")

    def stats(self, now_mono: float) -> dict:
        return {
            "id": self.id,
            "peer": self.peer,
            "tenant": self.tenant,
            "state": self.state,
            "age_s": round(time.time() - self.created, 3),
            "last_heartbeat_s": round(now_mono - self.last_seen, 3),
            "handles": len(self.handles),
            "bytes": self.data_bytes,
            "arena_leases": len(self.leases) + len(self.pending_release),
            "requests": self.requests,
            "phase": self.phase,
            "models": len(self.models),
            "objects": len(self.objects),
        }


def new_handle() -> str:
    return secrets.token_urlsafe(16)  # 128 random bits: unguessable
