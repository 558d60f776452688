"""Per-tenant quotas (issue 9 §4): limits on what all of one tenant's sessions hold.

Note [tenant quotas]: ``session_device_max`` / ``session_host_max`` bound one session; a
tenant opens as many sessions as it likes, so they do not bound a tenant. A session's
tenant is who the supervisor says it is (``WorkerSession.tenant``): ``token:NAME`` when
the client presented a tenant's own token (``tenant_tokens_file``), else its Unix user
(``uid:N``) or its TCP address (``host:ADDR``). ``tenant_device_max`` bounds the device
bytes (tensors and resident KV caches) of a tenant's open sessions on one worker, and
``tenant_host_max`` their host-tier bytes (arena slabs, swapped-out caches and tensors);
over either, QUOTA_EXCEEDED, as for a session. The limits are per worker: each worker
enforces them for the sessions it serves (the supervisor places a tenant's sessions on
several workers only when there are several devices).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from djinn.errors import QuotaExceeded

if TYPE_CHECKING:
    from .sessions import WorkerSession


def tenant(s: WorkerSession) -> str:
    return s.tenant or s.peer


class TenantQuotas:
    def __init__(
        self,
        device_max: int,
        host_max: int,
        sessions: Callable[[], Iterable[WorkerSession]],  # the worker's open sessions
        host_of: Callable[[str], int],  # a session's host-tier bytes, by id
    ) -> None:
        self.device_max = device_max
        self.host_max = host_max
        self.sessions = sessions
        self.host_of = host_of

    def _mates(self, s: WorkerSession) -> list[WorkerSession]:
        who = tenant(s)
        return [x for x in self.sessions() if tenant(x) == who]

    def check_device(self, s: WorkerSession, nbytes: int) -> None:
        if not self.device_max:
            return
        held = sum(x.data_bytes for x in self._mates(s))
        if held + nbytes > self.device_max:
            raise QuotaExceeded(
                f"device memory: the sessions of {tenant(s)} would hold {held + nbytes} "
                f"bytes on this worker, over the tenant's quota of {self.device_max} "
                "(tenant_device_max); free handles or KV caches first"
            )

    def check_host(self, session_id: str, nbytes: int) -> None:
        if not self.host_max:
            return
        s = next((x for x in self.sessions() if x.id == session_id), None)
        if s is None:
            return
        held = sum(self.host_of(x.id) for x in self._mates(s))
        if held + nbytes > self.host_max:
            raise QuotaExceeded(
                f"host memory: the sessions of {tenant(s)} would hold {held + nbytes} bytes "
                f"in the host tier, over the tenant's quota of {self.host_max} "
                "(tenant_host_max); free handles or KV caches first"
            )
