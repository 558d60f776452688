"""The memory manager: what is resident on the device, what waits in the host tier, and
making room when the device budget runs short (issue 9 §2, §3).

Units that can move are a registered model's weights and a session's KV caches (remote
objects); a KV cache may instead be dropped and recomputed from its tokens (Note [kv
recompute], recompute.py). A session's tensors (handles) move as one unit, and come back
before any request of that session runs (Note [session tensors on the host],
handle_tiers.py); activations are freed, not swapped. Under pressure ``reclaim`` asks
the configured policy (a plugin, ``djinn.memory_policies``) for victims and swaps them to
the arena (Note [swap by storage resize], vmu/tiers.py) until enough is free; before a call
runs, ``prepare`` pins its working set (the model and the KV caches among its
arguments) so nothing it needs is chosen, and swaps back in what was out. The worker is
single-threaded, so only the running call is ever in flight.

Note [think time]: a session's activity is tracked as two moving averages, the gap
between calls inside a burst (decode steps) and the pause between bursts (an agent's
tool call, a user reading): a gap over ``BURST_FACTOR`` times the in-burst average counts
as a pause. The semantic policy reads them through ``UnitFacts``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from djinn.errors import ExecutionError, QuotaExceeded, ResourceExhausted
from djinn.semantics.memory import (
    KV_CACHE,
    TENSORS,
    WEIGHTS,
    MemoryPolicy,
    MemoryView,
    UnitFacts,
)

from .handle_tiers import HandleTiers
from .recompute import DEFAULT_COPY_BPS, KvRecompute
from .store import _tensors_in
from .vmu.tiers import HostCopy, TierMover, movable

if TYPE_CHECKING:
    from .models import ModelCache, ModelEntry
    from .sessions import WorkerSession
    from .store import TensorStore

log = logging.getLogger("djinn.appliance.residency")

BURST_FACTOR = 4.0  # Note [think time]
EWMA = 0.3  # weight of the newest gap in the averages


@dataclass
class Counters:
    swaps_out: int = 0
    swaps_in: int = 0
    evictions: int = 0
    recomputes: int = 0  # KV caches rebuilt from their tokens (Note [kv recompute])
    bytes_out: int = 0
    bytes_in: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class Activity:
    """A session's rhythm (Note [think time])."""

    last_end: float = field(default_factory=time.monotonic)
    burst_gap: float = 0.0
    think: float = 0.0
    counters: Counters = field(default_factory=Counters)
    host_bytes: int = 0  # its KV caches waiting in the arena

    def started(self, now: float) -> None:
        gap = now - self.last_end
        if self.burst_gap and gap > BURST_FACTOR * self.burst_gap:
            self.think = gap if not self.think else (1 - EWMA) * self.think + EWMA * gap
        else:
            self.burst_gap = gap if not self.burst_gap else (1 - EWMA) * self.burst_gap + EWMA * gap


class MemoryManager:
    def __init__(
        self,
        store: TensorStore,
        models: ModelCache,
        sessions: Any,  # () -> iterable of open WorkerSessions
        mover: TierMover,
        policy: MemoryPolicy | None,
    ) -> None:
        self.store = store
        self.models = models
        self.sessions = sessions
        self.mover = mover
        self.policy = policy
        self.pinned: set[str] = set()
        self.model_out: dict[str, list[HostCopy]] = {}  # fingerprint -> its bytes on host
        self.kv_out: dict[tuple[str, str], list[HostCopy]] = {}  # (session, object id)
        self.model_counters: dict[str, Counters] = {}
        self.model_used: dict[str, float] = {}
        self.kv_used: dict[tuple[str, str], float] = {}
        self.activity: dict[str, Activity] = {}
        self.total = Counters()
        self.swap_failures = 0
        self.kv = KvRecompute()  # Note [kv recompute]; the worker sets its mode
        self.tensors = HandleTiers(store, mover)  # Note [session tensors on the host]
        self.host_peak = 0  # most bytes the host tier held (sampled at swaps and stats)
        if policy is not None:
            store.vmu.reclaim = self.reclaim

    # -- keys and facts -----------------------------------------------------------------
    def _act(self, session_id: str) -> Activity:
        act = self.activity.get(session_id)
        if act is None:
            act = self.activity[session_id] = Activity()
        return act

    def _kv_storages(self, s: WorkerSession, obj: Any) -> list:
        """A cache's own storages: not a handle's, not a model's weights."""
        taken = set(s.storages)
        for entry in self.models.entries.values():
            taken |= entry.storages
        out, seen = [], set()
        for t in _tensors_in(obj):
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if ptr in seen or ptr in taken or not movable(st):
                continue
            seen.add(ptr)
            out.append(st)
        return out

    def _model_storages(self, entry: ModelEntry) -> list:
        out, seen = [], set()
        for t in (*entry.module.parameters(), *entry.module.buffers()):
            st = t.untyped_storage()
            if st.data_ptr() not in seen and movable(st):
                seen.add(st.data_ptr())
                out.append(st)
        return out

    def _taken(self, s: WorkerSession) -> set[int]:
        """Storages a session's tensors share with its caches or any model's weights."""
        taken = {t.untyped_storage().data_ptr() for o in s.objects.values() for t in _tensors_in(o)}
        for entry in self.models.entries.values():
            taken |= entry.storages
        return taken

    def _tensor_unit(self, s: WorkerSession, now: float, act: Activity) -> UnitFacts | None:
        key = "t:" + s.id
        if key in self.pinned or not self.tensors.may_move(s):
            return None
        refs = self.tensors.movable_refs(s, self._taken(s))
        nbytes = sum(ref.nbytes for ref, _ in refs.values())
        if not nbytes:
            return None
        idle = self.tensors.idle_s(s, now)
        return UnitFacts(
            key,
            TENSORS,
            nbytes,
            1,
            idle,
            phase=s.phase,
            session_idle_s=idle,
            think_s=act.think,
            burst_gap_s=act.burst_gap,
        )

    def _candidates(self, now: float) -> list[UnitFacts]:
        units = []
        for fp, entry in self.models.entries.items():
            if fp in self.model_out or "m:" + fp in self.pinned:
                continue
            units.append(
                UnitFacts(
                    "m:" + fp,
                    WEIGHTS,
                    entry.nbytes,
                    len(entry.sessions),
                    now - self.model_used.get(fp, 0.0),
                )
            )
        for s in self.sessions():
            act = self._act(s.id)
            for oid, obj in s.objects.items():
                key = (s.id, oid)
                if key in self.kv_out or f"o:{s.id}:{oid}" in self.pinned:
                    continue
                nbytes = sum(st.nbytes() for st in self._kv_storages(s, obj))
                if not nbytes:
                    continue
                units.append(
                    UnitFacts(
                        f"o:{s.id}:{oid}",
                        KV_CACHE,
                        nbytes,
                        1,
                        now - self.kv_used.get(key, 0.0),
                        phase=s.phase,
                        session_idle_s=now - act.last_end,
                        think_s=act.think,
                        burst_gap_s=act.burst_gap,
                    )
                )
            tensors = self._tensor_unit(s, now, act)
            if tensors is not None:
                units.append(tensors)
        return units

    # -- eviction -----------------------------------------------------------------------
    def reclaim(self, need: int) -> int:
        """Swap units out, in the policy's order, until ``need`` bytes are free."""
        if self.policy is None or need <= 0:
            return 0
        now = time.monotonic()
        units = self._candidates(now)
        if sum(u.bytes for u in units) < need:
            return 0  # evicting everything would not do: keep it all (the call may wait)
        vmu = self.store.vmu
        view = MemoryView(
            need,
            vmu.capacity,
            vmu.used,
            self.store.slabs.capacity - self.store.slabs.used,
            tuple(units),
        )
        try:
            order = list(self.policy.victims(view))
        except Exception:  # a broken policy costs eviction order, never the request
            log.exception("memory policy %s failed; falling back to LRU", self.policy.name)
            order = [u.key for u in sorted(units, key=lambda u: -u.idle_s)]
        known = {u.key for u in units}
        freed = 0
        for key in order:
            if freed >= need:
                break
            if key not in known:
                continue
            known.discard(key)
            try:
                freed += self._swap_out(key)
            except ResourceExhausted:
                self.swap_failures += 1  # the arena is full: try the next victim
        return freed

    def _swap_out(self, key: str) -> int:
        before = self.store.vmu.used
        if key.startswith("m:"):
            fp = key[2:]
            entry = self.models.entries[fp]
            self.model_out[fp] = self.mover.out(self._model_storages(entry))
            # its old addresses are free memory now, soon another storage's: only what
            # still holds bytes is its weights (tests/unit/test_residency_addresses.py)
            entry.storages = {
                st.data_ptr()
                for t in (*entry.module.parameters(), *entry.module.buffers())
                if (st := t.untyped_storage()).nbytes() > 0
            }
            self.models.text.release(entry.nbytes)
            moved = sum(c.nbytes for c in self.model_out[fp])
            counters = self.model_counters.setdefault(fp, Counters())
        elif key.startswith("t:"):  # Note [session tensors on the host]
            s = next(x for x in self.sessions() if x.id == key[2:])
            taken = self._taken(s)
            refs = self.tensors.movable_refs(s, taken)
            self._check_host_quota(s.id, sum(ref.nbytes for ref, _ in refs.values()))
            moved = self.tensors.swap_out(s, taken)
            counters = self._act(s.id).counters
        else:
            _, sid, oid = key.split(":", 2)
            s = next(x for x in self.sessions() if x.id == sid)
            storages = self._kv_storages(s, s.objects[oid])
            counters = self._act(sid).counters
            if self._drop_instead(s, oid, storages):  # Note [kv recompute]
                self.kv.drop((sid, oid), storages)
                self.store.charge_objects(s)
                for c in (counters, self.total):
                    c.evictions += 1
                log.info("dropped %s to recompute it", key[:40])
                return before - self.store.vmu.used
            self._check_host_quota(sid, sum(st.nbytes() for st in storages))
            copies = self.mover.out(storages)
            self.kv_out[(sid, oid)] = copies
            self.store.charge_objects(s)  # the cache's storages now hold 0 bytes
            moved = sum(c.nbytes for c in copies)
            self._act(sid).host_bytes += moved
        for c in (counters, self.total):
            c.swaps_out += 1
            c.evictions += 1
            c.bytes_out += moved
        self.host_peak = max(self.host_peak, self.host_bytes())
        log.info("swapped out %s: %d bytes", key[:40], moved)
        return before - self.store.vmu.used

    def _drop_instead(self, s: WorkerSession, oid: str, storages: list) -> bool:
        """Note [kv recompute]: drop the cache (True) or swap it (False)."""
        rec = self.kv.recomputable(s, oid, storages)
        if rec is None or rec.fingerprint not in self.models.entries:
            return False
        nbytes = sum(st.nbytes() for st in storages)
        slabs = self.store.slabs
        can_swap = slabs.capacity - slabs.used >= nbytes
        try:
            self._check_host_quota(s.id, nbytes)
        except QuotaExceeded:
            can_swap = False
        mover = self.mover
        bps = mover.bytes_in / mover.seconds_in if mover.seconds_in > 0 else DEFAULT_COPY_BPS
        return self.kv.choose(rec, nbytes, bps, can_swap)

    def _check_host_quota(self, session_id: str, nbytes: int) -> None:
        """A session at its host quota keeps its caches on the device (issue 9 §4)."""
        slabs = self.store.slabs
        held = slabs.held.get(session_id, 0) + self.host_elsewhere(session_id)
        if slabs.host_max and held + nbytes > slabs.host_max:
            raise QuotaExceeded(f"session {session_id}: host quota full")
        slabs.tenant_host(session_id, nbytes)  # Note [tenant quotas]

    def host_elsewhere(self, session_id: str) -> int:
        act = self.activity.get(session_id)
        away = self.tensors.out.get(session_id)
        tensors = self.tensors.host_bytes_of(away) if away is not None else 0
        return (act.host_bytes if act is not None else 0) + tensors

    # -- a request's session ------------------------------------------------------------
    def begin(self, s: WorkerSession, kind: str) -> None:
        """Any request but a heartbeat: the session's tensors come back and stay while it
        runs (Note [session tensors on the host])."""
        moved = self.tensors.begin(s, kind)
        if moved:
            counters = self._act(s.id).counters
            for c in (counters, self.total):
                c.swaps_in += 1
                c.bytes_in += moved

    def end(self, s: WorkerSession, kind: str) -> None:
        self.tensors.end(s, kind)

    # -- a call's working set -----------------------------------------------------------
    def prepare(self, s: WorkerSession, entry: ModelEntry, oids: set[str]) -> None:
        """Pin what a call needs and bring back what of it was swapped out."""
        now = time.monotonic()
        self._act(s.id).started(now)
        fp = entry.fingerprint
        # added to what is pinned already: a batch pins every member's working set
        # (Note [cross-session batching]); finish() unpins all
        self.pinned |= {"m:" + fp} | {f"o:{s.id}:{oid}" for oid in oids}
        self.model_used[fp] = now
        self._model_in(entry)
        for oid in oids:
            key = (s.id, oid)
            self.kv_used[key] = now
            if key in self.kv.dropped:
                self._rebuild(s, oid)
                continue
            copies = self.kv_out.get(key)
            if copies is None:
                continue
            nbytes = sum(c.nbytes for c in copies)
            data = self.store.vmu["data"]
            data.reserve(nbytes)  # room first (may evict others); charge_objects recounts
            data.release(nbytes)
            self.mover.back(copies)
            del self.kv_out[key]
            act = self._act(s.id)
            act.host_bytes -= nbytes
            self.store.charge_objects(s)
            self._count_in(act.counters, copies)

    def _model_in(self, entry: ModelEntry) -> None:
        """Swap a model's weights back in if they are on the host."""
        fp = entry.fingerprint
        if fp not in self.model_out:
            return
        copies = self.model_out[fp]
        self.models.text.reserve(entry.nbytes)  # may evict others, never the pinned
        self.mover.back(copies)
        del self.model_out[fp]
        # resized storages have new addresses: the alias check needs the new ones
        entry.storages = {c.storage.data_ptr() for c in copies} | {
            st.data_ptr() for st in self._model_storages(entry)
        }
        self._count_in(self.model_counters.setdefault(fp, Counters()), copies)

    def _rebuild(self, s: WorkerSession, oid: str) -> None:
        """Note [kv recompute]: run the prefill that fills a dropped cache again, with
        room for the cache and the prefill's activations made first."""
        key = (s.id, oid)
        dropped = self.kv.dropped[key]
        entry = self.models.entries.get(dropped.fingerprint)
        if entry is None:
            raise ExecutionError(
                "a KV cache dropped under memory pressure cannot be rebuilt: the model that "
                "built it is no longer registered; start the prompt again"
            )
        self.pinned.add("m:" + entry.fingerprint)  # the model that rebuilds it stays
        self._model_in(entry)
        data, stack = self.store.vmu["data"], self.store.vmu["stack"]
        scratch = self.kv.stack_bytes(key, entry.module)
        data.reserve(dropped.nbytes)  # room first (may evict others); charge_objects recounts
        try:
            stack.reserve(scratch)
            try:
                self.kv.rebuild(key, s.objects[oid], entry.module)
            finally:
                stack.release(scratch)
        finally:
            data.release(dropped.nbytes)
        self.store.charge_objects(s)
        for c in (self._act(s.id).counters, self.total):
            c.recomputes += 1

    def _count_in(self, counters: Counters, copies: list[HostCopy]) -> None:
        moved = sum(c.nbytes for c in copies)
        for c in (counters, self.total):
            c.swaps_in += 1
            c.bytes_in += moved

    def finish(self, s: WorkerSession) -> None:
        self.pinned = set()
        act = self._act(s.id)
        act.last_end = time.monotonic()
        for oid in s.objects:  # caches the call made are in use now
            self.kv_used.setdefault((s.id, oid), act.last_end)

    # -- bytes going away ---------------------------------------------------------------
    def forget_objects(self, s: WorkerSession) -> None:
        """Free the host copies of caches the session no longer holds."""
        for key in [k for k in self.kv_out if k[0] == s.id and k[1] not in s.objects]:
            copies = self.kv_out.pop(key)
            for c in copies:
                self.store.slabs.free(c.offset)
            self._act(s.id).host_bytes -= sum(c.nbytes for c in copies)
        for key in [k for k in self.kv_used if k[0] == s.id and k[1] not in s.objects]:
            del self.kv_used[key]
        self.kv.forget(s.id, set(s.objects))

    def forget_session(self, s: WorkerSession) -> None:
        self.forget_objects(s)
        self.kv.forget(s.id)
        self.tensors.forget(s.id)
        self.activity.pop(s.id, None)

    def forget_model(self, fp: str) -> bool:
        """A freed model's host copy goes too; True if its weights were on the host."""
        copies = self.model_out.pop(fp, None)
        for c in copies or ():
            self.store.slabs.free(c.offset)
        self.model_counters.pop(fp, None)
        self.model_used.pop(fp, None)
        return copies is not None

    # -- visibility ---------------------------------------------------------------------
    def model_stats(self, fp: str, nbytes: int) -> dict[str, Any]:
        host = sum(c.nbytes for c in self.model_out.get(fp, []))
        counters = self.model_counters.get(fp, Counters())
        return {
            "device_bytes": 0 if host else nbytes,
            "host_bytes": host,
            **counters.as_dict(),
        }

    def session_stats(self, session_id: str) -> dict[str, Any]:
        act = self.activity.get(session_id)
        if act is None:
            return {"host_bytes": 0, **Counters().as_dict()}
        return {"host_bytes": self.host_elsewhere(session_id), **act.counters.as_dict()}

    def host_bytes(self) -> int:
        return (
            sum(c.nbytes for v in self.model_out.values() for c in v)
            + sum(c.nbytes for v in self.kv_out.values() for c in v)
            + self.tensors.host_bytes()
        )

    def stats(self) -> dict[str, Any]:
        host = self.host_bytes()
        self.host_peak = max(self.host_peak, host)
        return {
            "policy": self.policy.name if self.policy is not None else "off",
            "host_bytes": host,
            "host_peak": self.host_peak,
            "swap_failures": self.swap_failures,
            "swap_in_s": round(self.mover.seconds_in, 6),
            "swap_out_s": round(self.mover.seconds_out, 6),
            **self.kv.stats(),
            **self.total.as_dict(),
        }
