"""Session tensors (handles) between the device and the host tier (issue 9 §2).

Note [session tensors on the host]: the tensors a session keeps (PUT results, graph
outputs) are one movable unit per session, ``t:<session>``, that the memory policy may
choose like a KV cache. Swapping them out is the storage resize of Note [swap by storage
resize]: each handle keeps its tensor object, shape and strides, its bytes wait in an
arena slab (``StorageRef.away``), and the device budget no longer pays for them. Before
any request of that session other than a heartbeat runs (``begin``), all of its tensors
come back bit-identical, so every handler (GET, EXEC, CALL, REGISTER...) reads resident
tensors without knowing tiers exist. A handle freed while away frees its slab
(``TensorStore.drop``).

What is never moved: storages in the arena already (a same-host PUT on a CPU worker keeps
its slab), weights staged for REGISTER, storages a KV cache or a model also holds, and
the tensors of a session with a request under way (its graph may be half-run between
two slices), a request scheduled, or a reply still being sent from its tensors' memory
(``busy``).

Storages are keyed by their address in ``WorkerSession.storages``; a resized storage
changes address, so while away a storage is keyed by a unique negative number (a new
tensor at the old address must not be taken for an alias of it) and it is re-keyed by
its new address when it comes back.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .vmu.tiers import TierMover, movable

if TYPE_CHECKING:
    from .sessions import StorageRef, WorkerSession
    from .store import TensorStore

QUIET_KINDS = frozenset({"HEARTBEAT", "PING", "ALLOC", "FREE"})  # nothing needs to come back


class HandleTiers:
    def __init__(self, store: TensorStore, mover: TierMover) -> None:
        self.store = store
        self.mover = mover
        self.out: dict[str, WorkerSession] = {}  # sessions whose tensors wait on the host
        self.active: set[str] = set()  # sessions with a request under way
        self.busy: Callable[[Any], bool] = lambda s: False  # set by the worker
        self.last_request: dict[str, float] = {}  # when each session's last request ended
        self._keys = itertools.count(-1, -1)

    # -- what may move ------------------------------------------------------------------
    def movable_refs(self, s: WorkerSession, taken: set[int]) -> dict[int, tuple[StorageRef, Any]]:
        """key -> (ref, storage) of the session's storages a swap may free."""
        found: dict[int, tuple[StorageRef, Any]] = {}
        for t, key in s.handles.values():
            if key in found or key < 0:
                continue
            ref = s.storages.get(key)
            if ref is None or ref.slab is not None or ref.host or ref.away is not None:
                continue
            st = t.untyped_storage()
            if movable(st) and st.data_ptr() not in taken and st.nbytes() == ref.nbytes:
                found[key] = (ref, st)
        return found

    def may_move(self, s: WorkerSession) -> bool:
        return s.id not in self.out and s.id not in self.active and not self.busy(s)

    def idle_s(self, s: WorkerSession, now: float) -> float:
        return now - self.last_request.setdefault(s.id, now)

    # -- moving ---------------------------------------------------------------------------
    def swap_out(self, s: WorkerSession, taken: set[int]) -> int:
        """Copy the session's movable tensors to the host and free them on the device.
        All or nothing (a full arena raises before anything moved). Returns bytes moved."""
        refs = self.movable_refs(s, taken)
        if not refs:
            return 0
        copies = self.mover.out([st for _, st in refs.values()])
        rekey: dict[int, int] = {}
        data = self.store.vmu["data"]
        for (key, (ref, _)), copy in zip(refs.items(), copies, strict=True):
            ref.away = copy
            rekey[key] = next(self._keys)
            s.storages[rekey[key]] = s.storages.pop(key)
            data.release(ref.nbytes)
            s.data_bytes -= ref.nbytes
        self._rekey(s, rekey)
        self.out[s.id] = s
        return sum(c.nbytes for c in copies)

    def begin(self, s: WorkerSession, kind: str) -> int:
        """A request of ``s`` starts: its tensors stay, and come back if they were away.
        Returns the bytes brought back (0 when none were away)."""
        self.active.add(s.id)
        if kind in QUIET_KINDS or s.id not in self.out:
            return 0
        away = [(key, ref) for key, ref in s.storages.items() if ref.away is not None]
        nbytes = sum(ref.nbytes for _, ref in away)
        self.store.vmu["data"].reserve(nbytes)  # may evict others, never this session
        copies = [ref.away for _, ref in away]
        self.mover.back(copies)  # frees the slabs
        del self.out[s.id]
        rekey = {}
        for (key, ref), copy in zip(away, copies, strict=True):
            ref.away = None
            rekey[key] = copy.storage.data_ptr()
            s.storages[rekey[key]] = s.storages.pop(key)
        s.data_bytes += nbytes
        self._rekey(s, rekey)
        return sum(c.nbytes for c in copies)

    def end(self, s: WorkerSession, kind: str) -> None:
        self.active.discard(s.id)
        if kind not in QUIET_KINDS:
            self.last_request[s.id] = time.monotonic()

    @staticmethod
    def _rekey(s: WorkerSession, rekey: dict[int, int]) -> None:
        if rekey:
            for h, (t, key) in list(s.handles.items()):
                if key in rekey:
                    s.handles[h] = (t, rekey[key])

    # -- accounting -----------------------------------------------------------------------
    @staticmethod
    def host_bytes_of(s: WorkerSession) -> int:
        return sum(r.away.nbytes for r in s.storages.values() if r.away is not None)

    def host_bytes(self) -> int:
        return sum(self.host_bytes_of(s) for s in self.out.values())

    def forget(self, session_id: str) -> None:
        """The session ended (its handles, and so their slabs, were freed by the store)."""
        self.out.pop(session_id, None)
        self.active.discard(session_id)
        self.last_request.pop(session_id, None)
