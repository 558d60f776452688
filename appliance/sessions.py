"""Worker-side sessions: the handles, storages and arena slabs a client owns.

A session is pinned to one worker and lives on the connection the supervisor handed
over. It ends in one of three ways, and each frees everything it holds:
closed by the client, its connection dropped (the client died), its lease ran out
(no request or heartbeat for ``interval * misses`` seconds), or an operator ended it
(KILL_SESSION). An expired or ended session keeps a tombstone on its connection so later
calls get SESSION_EXPIRED or SESSION_ENDED instead of a fresh, empty session.
"""

from __future__ import annotations

import re
import secrets
import socket
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import torch

from djinn.errors import DjinnError, InvalidArgument, NotFound, error_from_wire
from djinn.transport.framing import FrameReader

from .outbox import Outbox

OPEN, EXPIRED, CLOSED, ENDED = "open", "expired", "closed", "ended"
FAILED_PUTS = 256  # failed PUT names a session remembers (Note [puts sent without waiting])
FAILED_EXECS = 16  # failed EXEC request ids a session remembers (Note [replays sent ahead])
FAILED_MESSAGE_MAX = 1024  # of each one's error message
# a handle a client names: what new_handle() makes (22 url-safe characters), up to 64
CLIENT_HANDLE = re.compile(r"[A-Za-z0-9_-]{16,64}")


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
    # receive slabs of the frame being read, by segment: Note [receive slabs] (receive.py)
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
    muted: bool = False  # out of the worker's selector while a request of it is parked
    # Note [puts sent without waiting]: names of this session's PUTs that failed, and why
    failed_puts: OrderedDict[str, tuple[str, str]] = field(default_factory=OrderedDict)
    # Note [replays sent ahead]: request ids of its last EXECs that failed, which an EXEC
    # sent behind one of them (its "after") must not run after
    failed_execs: deque[int] = field(default_factory=lambda: deque(maxlen=FAILED_EXECS))

    def failed(self, kind: str, rid: int) -> None:
        """Request ``rid`` (of ``kind``) was answered with an error: an EXEC sent behind an
        EXEC that failed must not run (Note [replays sent ahead])."""
        if kind == "EXEC":
            self.failed_execs.append(rid)

    def touch(self) -> None:
        self.last_seen = time.monotonic()

    def expired(self, now: float) -> bool:
        return self.state == OPEN and now - self.last_seen > self.lease_s

    def tensor(self, handle: str) -> torch.Tensor:
        try:
            return self.handles[handle][0]
        except (KeyError, TypeError):
            failed = self.failed_puts.get(handle) if isinstance(handle, str) else None
            if failed is not None:  # Note [puts sent without waiting]: say why it is not here
                message = f"handle {handle!r}: its PUT failed: {failed[1]}"
                raise error_from_wire(failed[0], message) from None
            raise NotFound(f"no handle {handle!r} in this session") from None

    def put_failed(self, names: list[Any], exc: DjinnError) -> None:
        """Remember why the PUT that named ``names`` kept nothing (the last FAILED_PUTS).
        Only well-formed names, and the error's code and message, not the error: its
        traceback holds the request's payload (a review's over-quota puts kept 386 MB)."""
        why = (exc.code, exc.message[:FAILED_MESSAGE_MAX])
        for name in names:
            if isinstance(name, str) and CLIENT_HANDLE.fullmatch(name) and name not in self.handles:
                self.failed_puts[name] = why
        while len(self.failed_puts) > FAILED_PUTS:
            self.failed_puts.popitem(last=False)

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


def client_names(s: WorkerSession, names: list[Any]) -> None:
    """Check the handles a PUT names (Note [puts sent without waiting]): well formed, new
    to the session and distinct. Names live in the session's own table, so a name can
    never reach another session's tensor, whatever the client picks."""
    seen: set[str] = set()
    for name in names:
        if not isinstance(name, str) or not CLIENT_HANDLE.fullmatch(name):
            raise InvalidArgument(
                f"a PUT name must be 16-64 characters of [A-Za-z0-9_-], got {name!r:.80}"
            )
        if name in s.handles or name in seen:
            raise InvalidArgument(f"handle {name!r} is already in use in this session")
        seen.add(name)
