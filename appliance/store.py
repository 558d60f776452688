"""A worker's memory: its share of the host arena, its device VMU, and session storage.

Accounting is per *storage*, not per handle: two handles viewing one block (a tensor and
its transpose) are charged once, and the block (and its arena slab, if it lives in one)
is freed when the last handle viewing it is dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from djinn.errors import QuotaExceeded
from djinn.transport.arena import ArenaMapping

from .sessions import StorageRef, WorkerSession, new_handle
from .vmu.device import DeviceVMU
from .vmu.slabs import SlabAllocator


def _tensors_in(obj: object, depth: int = 0):
    """Tensors reachable from an object (a transformers Cache: layers -> keys/values)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth > 5:
        return
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors_in(v, depth + 1)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_in(v, depth + 1)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        for v in vars(obj).values():
            yield from _tensors_in(v, depth + 1)


def storage_key(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


class TensorStore:
    def __init__(
        self, arena: ArenaMapping, base: int, size: int, vmu: DeviceVMU, **shares: Any
    ) -> None:
        self.arena = arena
        self.slabs = SlabAllocator(base, size, **shares)  # Note [arena shares] (slabs.py)
        self.vmu = vmu
        self.device_max = 0  # session_device_max (issue 9 §4); 0: no quota
        # tenant_device_max (Note [tenant quotas], tenant_quota.py), set by the worker
        self.tenant_check: Callable[[WorkerSession, int], None] = lambda s, n: None
        self._arena_ptr = 0
        if arena.size:
            self._arena_ptr = torch.frombuffer(arena.view, dtype=torch.uint8).data_ptr()

    # -- arena slabs ------------------------------------------------------------------
    def lease(self, session: WorkerSession, nbytes: int) -> int:
        off = self.slabs.alloc(nbytes, session.id)
        session.leases[off] = nbytes
        return off

    def slab_tensor(self, off: int, nbytes: int) -> torch.Tensor:
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(self.arena.slab(off, nbytes), dtype=torch.uint8)

    def arena_offset(self, t: torch.Tensor) -> int | None:
        """Offset of ``t``'s first byte if it lives in the arena (CPU tensors only)."""
        if not self._arena_ptr or t.device.type != "cpu" or not t.numel():
            return None
        off = t.data_ptr() - self._arena_ptr
        return off if 0 <= off < self.arena.size else None

    # -- handles ------------------------------------------------------------------------
    def keep(
        self,
        session: WorkerSession,
        t: torch.Tensor,
        slab: int | None = None,
        host: bool = False,
        name: str | None = None,
    ) -> str:
        """Give ``t`` a handle in ``session`` (``name``: the one its client chose, already
        checked by ``client_names``); reserve its storage in the data segment, or with
        ``host`` (weights staged in their arena slab for REGISTER) in the arena only."""
        key = storage_key(t)
        if not key[1] and slab is not None:
            self.slabs.free(slab)  # nothing to keep in it: a zero-byte tensor owns no slab
            slab = None
        host = host and slab is not None
        ref = session.storages.get(key[0]) if key[1] else None
        if ref is None:
            if not host:
                self.check_quota(session, key[1])
                self.vmu["data"].reserve(key[1])
                session.data_bytes += key[1]
            ref = StorageRef(key[1], slab=slab, host=host)
            if key[1]:
                session.storages[key[0]] = ref
                session.staged_bytes += key[1] if host else 0
        ref.refs += 1
        handle = name or new_handle()
        session.handles[handle] = (t, key[0])
        return handle

    def unstage(self, session: WorkerSession) -> None:
        """Note [staged uploads]: the upload they were staged for is over, and the session
        keeps them as ordinary tensors: charged like any other from now on (quota and
        device budget), all or none. They bypassed the device quota before."""
        refs = [ref for ref in session.storages.values() if ref.host]
        total = sum(ref.nbytes for ref in refs)
        self.check_quota(session, total)
        self.vmu["data"].reserve(total)
        for ref in refs:
            ref.host = False
        session.data_bytes += total
        session.staged_bytes = 0

    def check_quota(self, session: WorkerSession, nbytes: int) -> None:
        """Refuse ``nbytes`` more device memory for a session at its quota."""
        if self.device_max and session.data_bytes + nbytes > self.device_max:
            raise QuotaExceeded(
                f"device memory: this session would hold {session.data_bytes + nbytes} "
                f"bytes, over its quota of {self.device_max} (session_device_max); "
                "free handles or KV caches first"
            )
        self.tenant_check(session, nbytes)

    def charge_objects(self, session: WorkerSession) -> int:
        """Re-measure the tensors remote objects hold (a KV cache grows every decode step)
        and charge the difference to the data segment. Returns the bytes now held."""
        seen: set[int] = set(session.storages)  # handles are already charged
        total = 0
        for obj in session.objects.values():
            for t in _tensors_in(obj):
                storage = t.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
        delta = total - session.object_bytes
        self.vmu["data"].grow(delta)
        session.data_bytes += delta
        session.object_bytes = total
        return total

    def recharge(self, session: WorkerSession, handles: Iterable[str]) -> None:
        """Charge storages that grew while a graph ran (an ``out=`` op resizing a handle):
        the accounting must follow the memory actually held, even past the capacity.

        Only ``handles``, the ones the graph named, can have grown: a graph reaches a
        session's storage through its handles alone. (Every handle was walked after every
        graph: 3 ms a step for a training loop that kept its 3,000 batches on the device.)

        A resize moves the bytes, and storages are keyed by address (``storage_key``): a
        moved storage is re-keyed, or a new tensor at its old address would be taken for a
        view of it and charged nothing. A zero-byte handle owns no ``StorageRef``; when
        ``out=`` gives it bytes it gets one, charged whole (both were missed before
        2026-11-26: ``torch.add(x, 1, out=torch.empty(0))`` held 1 MiB for free)."""
        changed: set[int] = set()  # the storages (StorageImpl) that grew or moved
        for handle in handles:
            entry = session.handles.get(handle)
            if entry is None:
                continue
            t, key = entry
            st = t.untyped_storage()
            now = st.nbytes()
            if not now:
                continue
            ref = session.storages.get(key)
            if ref is None or st.data_ptr() != key or now > ref.nbytes:
                changed.add(st._cdata)
        if changed:
            self._rekey(session, changed)

    def _rekey(self, session: WorkerSession, changed: set[int]) -> None:
        """Key each storage in ``changed`` by its address now, with every handle of it
        (named by the graph or not: a walk of them all, rare), charged what it holds. Every
        old key is let go before any new one is taken: one graph may move a storage onto
        the address another just left."""
        groups: dict[int, list[str]] = {}
        for handle, (t, _key) in session.handles.items():
            impl = t.untyped_storage()._cdata
            if impl in changed:
                groups.setdefault(impl, []).append(handle)
        olds: dict[int, list[StorageRef]] = {}
        for impl, members in groups.items():
            keys = {session.handles[h][1] for h in members}
            olds[impl] = [r for k in keys if (r := session.storages.pop(k, None)) is not None]
        for impl, members in groups.items():
            t = session.handles[members[0]][0]
            st = t.untyped_storage()
            old = olds[impl]
            ref = old[0] if len(old) == 1 else StorageRef(sum(r.nbytes for r in old))
            held = ref.nbytes
            ref.nbytes, ref.refs = st.nbytes(), len(members)
            if not ref.host:
                delta = ref.nbytes - held
                if delta > 0:
                    self.vmu["data"].grow(delta)
                else:
                    self.vmu["data"].release(-delta)
                session.data_bytes += delta
            session.storages[st.data_ptr()] = ref
            for h in members:
                session.handles[h] = (session.handles[h][0], st.data_ptr())

    def drop(self, session: WorkerSession, handle: str) -> None:
        entry = session.handles.pop(handle, None)
        if entry is None:
            return
        ref = session.storages.get(entry[1])
        if ref is None:
            return  # zero-byte tensor
        ref.refs -= 1
        if ref.refs == 0:
            del session.storages[entry[1]]
            if ref.away is not None:  # in the host tier (Note [session tensors on the host])
                self.slabs.free(ref.away.offset)
                ref.away = None
            elif ref.host:
                session.staged_bytes -= ref.nbytes
            else:
                self.vmu["data"].release(ref.nbytes)
                session.data_bytes -= ref.nbytes
            if ref.slab is not None:
                self.slabs.free(ref.slab)

    def release_slabs(self, session: WorkerSession, offsets: object) -> None:
        """Reply slabs the client has finished reading, and slabs it leased ahead and
        gives back unused (Note [lease ahead]); it lists them in a later request."""
        if not isinstance(offsets, list):
            return
        for off in offsets[:65536]:
            if off in session.pending_release:
                session.pending_release.remove(off)
                self.slabs.free(off)
            elif type(off) is int and session.leases.pop(off, None) is not None:
                self.slabs.free(off)

    def release_pending(self, session: WorkerSession) -> None:
        while session.pending_release:
            self.slabs.free(session.pending_release.pop())

    def free_objects(self, session: WorkerSession) -> None:
        session.objects.clear()
        session.object_ids.clear()
        self.charge_objects(session)

    def free_session(self, session: WorkerSession) -> None:
        for handle in list(session.handles):
            self.drop(session, handle)
        self.release_pending(session)
        for off in list(session.leases):
            self.slabs.free(off)
        session.leases.clear()
