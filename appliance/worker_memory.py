"""A worker's memory manager and the quotas it enforces, wired to the worker's store, models,
sessions and scheduler (Note [one device budget], vmu/device.py; residency.py)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from djinn.semantics.registry import default_registry

from .residency import MemoryManager
from .sessions import OPEN
from .tenant_quota import TenantQuotas
from .vmu.tiers import TierMover

if TYPE_CHECKING:
    from .sessions import WorkerSession
    from .worker import Worker

log = logging.getLogger("djinn.appliance.worker")


def memory_manager(w: Worker, init: dict[str, Any]) -> MemoryManager:
    """Note [one device budget]: the memory policy ('off': nothing moves) decides what
    the manager swaps to the arena when the device budget runs short."""
    policy, policy_name = None, init.get("memory_policy", "semantic")
    if policy_name != "off":
        policy = default_registry().memory_policy(policy_name)
        if policy is None:
            log.warning("memory policy %r did not load: nothing will be evicted", policy_name)
    mover = TierMover(w.device.torch_device, w.store.slabs, w.store.slab_tensor)
    memory = MemoryManager(
        w.store,
        w.models,
        lambda: [s for s in w.sessions.values() if s.state == OPEN],
        mover,
        policy,
    )
    w.models.on_free = memory.forget_model
    memory.kv.mode = str(init.get("kv_recompute", "auto"))  # Note [kv recompute]
    # Note [session tensors on the host]: not while a request of theirs is scheduled
    # (a graph may be half-run) or a reply is sent from their memory
    memory.tensors.busy = lambda s: w.scheduler.has(s) or bool(s.outbox)
    # per-session quotas (issue 9 §4)
    w.store.device_max = int(init.get("session_device_max") or 0)
    w.store.slabs.host_max = int(init.get("session_host_max") or 0)
    w.store.slabs.host_elsewhere = memory.host_elsewhere
    tenants = TenantQuotas(  # Note [tenant quotas]
        int(init.get("tenant_device_max") or 0),
        int(init.get("tenant_host_max") or 0),
        lambda: [s for s in w.sessions.values() if s.state == OPEN],
        lambda sid: w.store.slabs.held.get(sid, 0) + memory.host_elsewhere(sid),
    )
    w.store.tenant_check = tenants.check_device
    w.store.slabs.tenant_host = tenants.check_host
    return memory


def free_released(w: Worker, s: WorkerSession, handles: Any, objects: Any = None) -> None:
    """Handles and remote objects the client's garbage collector released, sent along
    with a request."""
    if isinstance(handles, list):
        for h in handles[:65536]:
            if isinstance(h, str):
                w.store.drop(s, h)
    if isinstance(objects, list):
        for oid in objects[:65536]:
            obj = s.objects.pop(oid, None) if isinstance(oid, str) else None
            if obj is not None:
                s.object_ids.pop(id(obj), None)
        w.store.charge_objects(s)
        w.memory.forget_objects(s)  # swapped-out caches among them
