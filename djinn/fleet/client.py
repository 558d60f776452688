"""The client side of a fleet: ``djinn.connect("fleet://…")`` / ``("ray://…")``.

A ``FleetClient`` looks like a ``Client`` to the rest of Djinn (``session()``,
``stats()``, ``close()``), so the transparent frontend and ``djinn run`` use a fleet
with no change. Each session is placed on one appliance by the directory and then talks
to that appliance alone, over TCP: Ray is asked where, never carries a tensor.

Note [lazy placement]: a session is placed at its first use, not when it is opened.
``model.to("remote_accelerator")`` opens the process's default session and registers the
model with it as its first request, so the directory sees that model's fingerprint and
sends the session where the weights already are. A session whose first use is something
else (a tensor, a graph) is placed by load and free memory, and a model it registers
later is uploaded to that appliance if it is not there. ``client.session(model=fp)``
places at once, by a fingerprint the caller knows (``djinn.frontend.remote_module.
fingerprint(module)``).

Note [appliance loss]: when the appliance holding a session is gone (Ray reports its node
dead, or it no longer answers on its endpoint), every call of the session and every read
of a tensor it held raises one error, ``ApplianceLost`` (APPLIANCE_LOST, a kind of
SESSION_LOST), naming the appliance, its node and why. A watcher thread asks the directory
about the appliances in use every ``fleet_report_interval`` and cuts the sockets of
sessions on dead ones, so a call waiting on a vanished host fails then, not after the
socket timeout. The next session, including the transparent frontend's replacement
default session, is placed on a live appliance.

Note [fleet recovery]: a session opened with ``recover=True`` (the transparent frontend's
default session is, unless ``recovery_retries = 0``) keeps the lineage journal of
djinn/runtime/lineage.py. Its loss is then raised as the WORKER_LOST / SESSION_LOST that
the journal recovers from, and the journal's reopen (``FleetSession._reopen``) places the
session again, away from the lost appliance, by the model it was first placed by; the
journal then replays what the session held (registrations, tensors, caches) there and
the request is sent again. If that fails ``recovery_retries`` times, RECOVERY_FAILED
names the appliance's loss.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
import weakref
from typing import Any

from djinn import config as config_mod
from djinn.errors import Unavailable
from djinn.runtime.client import Client
from djinn.runtime.session import Session
from djinn.transport.address import parse_address

from .address import parse_fleet_address
from .cluster import connect_ray, get_directory
from .session import FleetSession

log = logging.getLogger("djinn.fleet.client")

DIRECTORY_TIMEOUT_S = 30.0
CLOSE_WAIT_S = 5.0  # how long close() waits for the watcher's directory call to end
PROBE_TIMEOUT_S = 1.0
UNREACHABLE_S = 10.0  # an appliance this client could not reach is not asked for again


class FleetClient:
    """A fleet of appliances behind one directory; a new session per ``session()``."""

    def __init__(self, address: str, token: str | None = None) -> None:
        import ray

        self.address = parse_fleet_address(address)
        cfg = config_mod.load()
        connect_ray(self.address.ray_address)
        self.directory = get_directory()
        self.token = (
            token
            or config_mod.read_token(cfg)
            or ray.get(self.directory.token.remote(), timeout=DIRECTORY_TIMEOUT_S)
        )
        self.interval = float(cfg.fleet_report_interval)
        self._clients: dict[str, Client] = {}
        self._sessions: weakref.WeakSet[FleetSession] = weakref.WeakSet()
        self._unreachable: dict[str, float] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._watcher: threading.Thread | None = None
        self._states: dict[str, tuple[str, str]] = {}

    # -- sessions ---------------------------------------------------------------------------
    def session(
        self, model: str | None = None, *, appliance: str | None = None, recover: bool = False
    ) -> FleetSession:
        """A session, placed at its first use (Note [lazy placement]), or at once on the
        appliance that suits ``model`` (a fingerprint) when given, or on ``appliance``
        (an id from the fleet document). ``recover=True``: when its appliance is lost it
        is placed again and what it held is replayed there (Note [fleet recovery])."""
        return FleetSession(self, model, appliance, recover)

    def _open(self, session: FleetSession, model: str | None, *, reopen: bool = False) -> None:
        """Place ``session`` and open it on the chosen appliance; an appliance that cannot
        be reached is left out and the directory asked again. ``reopen``: the session
        was open on an appliance that is gone (Note [fleet recovery])."""
        import ray

        tried: list[str] = []
        while True:
            now = time.monotonic()
            with self._lock:
                skip = [a for a, until in self._unreachable.items() if until > now]
            started = time.perf_counter()
            pinned = None if reopen else session.pinned
            choice = ray.get(
                self.directory.place.remote(model, skip + tried, pinned),
                timeout=DIRECTORY_TIMEOUT_S,
            )
            session.place_s = time.perf_counter() - started
            if "error" in choice:
                raise Unavailable(choice["error"])
            try:
                client = self._client_for(choice["endpoint"])
                if reopen:
                    session.client = client
                    session.appliance, session.endpoint = choice["id"], choice["endpoint"]
                    session._fleet_lost = False
                    Session._reopen(session)
                else:
                    Session.__init__(session, client, recover=session._fleet_recover)
            except Unavailable as exc:
                log.warning("appliance %s unreachable (%s); placing again", choice["id"], exc)
                tried.append(choice["id"])
                self.forget(choice["id"], choice["endpoint"])
                continue
            session.appliance, session.endpoint = choice["id"], choice["endpoint"]
            session.open_s = time.perf_counter() - started
            with self._lock:
                self._sessions.add(session)
            self._ensure_watcher()
            return

    def forget(self, appliance: str, endpoint: str) -> None:
        """Place nothing on ``appliance`` from this client for a while; drop its client."""
        with self._lock:
            self._unreachable[appliance] = time.monotonic() + UNREACHABLE_S
            stale = self._clients.pop(endpoint, None)
        if stale is not None:
            stale.close()

    def _client_for(self, endpoint: str) -> Client:
        with self._lock:
            client = self._clients.get(endpoint)
        if client is None:
            fresh = Client(endpoint, self.token)
            with self._lock:
                client = self._clients.setdefault(endpoint, fresh)
            if client is not fresh:  # another thread connected first
                fresh.close()
        return client

    # -- losses -----------------------------------------------------------------------------
    def verdict(self, appliance: str, endpoint: str, why: str) -> str | None:
        """Why ``appliance`` is gone, or None if it still answers (then only a worker of
        it died, and the session's loss is the ordinary SESSION_LOST)."""
        import ray

        # asked from a session's heartbeat thread too, when close() cut its connection:
        # a Ray call after the program's ray.shutdown() would connect it again (Ray's
        # auto-init), and the driver could then not take its own cluster down
        if not self._closed.is_set() and ray.is_initialized():
            with contextlib.suppress(Exception):
                state, now_at = ray.get(self.directory.states.remote(), timeout=5).get(
                    appliance, ("dead", "")
                )
                if state == "dead" or now_at != endpoint:
                    row = ray.get(self.directory.describe.remote(appliance), timeout=5)
                    return f"the fleet lost it: {row.get('why') or 'Ray reports it dead'}"
        addr = parse_address(endpoint)
        try:
            socket.create_connection((addr.host, addr.port), PROBE_TIMEOUT_S).close()
        except OSError as exc:
            return f"it no longer answers at {endpoint} ({exc}; the connection: {why})"
        return None

    def _ensure_watcher(self) -> None:
        with self._lock:
            if self._watcher is None:
                self._watcher = threading.Thread(
                    target=self._watch, name="djinn-fleet-watcher", daemon=True
                )
                self._watcher.start()

    def _watch(self) -> None:
        import ray

        while not self._closed.wait(self.interval):
            with self._lock:
                sessions = [s for s in self._sessions if s.usable]
            if not sessions:
                continue
            if self._closed.is_set() or not ray.is_initialized():
                return  # (as in verdict: never a Ray call after ray.shutdown())
            try:
                states = ray.get(self.directory.states.remote(), timeout=DIRECTORY_TIMEOUT_S)
            except Exception as exc:  # the directory is unreachable: sessions go on
                log.warning("fleet directory unreachable: %s", exc)
                continue
            self._states = states
            for s in sessions:
                state, endpoint = states.get(s.appliance, ("dead", ""))
                if state == "dead" or endpoint != s.endpoint:
                    s._cut(f"the fleet lost it (the directory says {s.appliance} is {state})")

    # -- the Client surface -----------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """The fleet document (``djinn status --fleet --json``)."""
        import ray

        return ray.get(self.directory.snapshot.remote(), timeout=DIRECTORY_TIMEOUT_S)

    def ping(self) -> None:
        self.stats()

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
            watcher = self._watcher
        for c in clients:
            c.close()
        # The watcher may be inside a directory call: waited for, so that nothing of this
        # client touches Ray after close (an actor call after the program's ray.shutdown()
        # would quietly connect the process to the cluster again). A directory that does
        # not answer holds the close up for a few seconds, not the call's whole timeout.
        if watcher is not None and watcher is not threading.current_thread():
            watcher.join(CLOSE_WAIT_S)

    def __enter__(self) -> FleetClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"FleetClient({self.address})"
