"""The fleet directory: a named Ray actor that knows every appliance and places sessions.

One per fleet (``DIRECTORY_NAME`` in ``NAMESPACE``). A monitor thread, every
``fleet_report_interval`` seconds:

1. asks Ray which nodes are alive and offer the ``djinn_appliance`` resource, and starts
   an appliance actor (``appliance_actor.py``) on each such node that has none; a node
   that joins later grows the fleet with no restart;
2. marks the appliances of nodes Ray reports dead as ``dead`` (Ray's node health checks
   are the detector), and those whose actor died or whose `djinn serve` exited too;
3. polls each live appliance for its summary (free memory, load, resident models).

``place`` runs the placement policy (a ``djinn.placement`` plugin) over the live
appliances and returns the chosen one's endpoint; clients then connect to it directly.

Note [pending placements]: an appliance's report lags what the directory has already
decided: a session placed a moment ago, and the model it is uploading, are not in it yet.
Twelve clients starting together would all see an empty fleet and, by free memory alone,
pile onto one appliance, or upload one model to three. So each placement is remembered
as pending on its appliance (``ApplianceFacts.pending_*``) until a report shows it (the
model resident) or it ages out (``PENDING_SESSION_S``, ``PENDING_MODEL_S``).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from djinn.semantics.placement import PlacementView

from .rows import DEAD, STALE, STARTING, UP, Row

log = logging.getLogger("djinn.fleet.directory")

NAMESPACE = "djinn"
DIRECTORY_NAME = "djinn-fleet"
RESOURCE = "djinn_appliance"  # a node offering one unit of it runs an appliance
STALE_AFTER_REPORTS = 5  # a live appliance silent for this many intervals is not placed on
RETRY_AFTER_S = 10.0  # a node whose appliance failed to start is retried after this
SCHEMA = 1


class FleetDirectory:
    """Run as a Ray actor (``cluster.start_directory``); methods are called remotely."""

    def __init__(
        self,
        settings: dict[str, Any],
        token: str,
        placement: str = "semantic",
        report_interval: float = 0.5,
        bind_host: str = "",
    ) -> None:
        self.settings = settings
        self._token = token
        self.placement = placement
        self.interval = report_interval
        self.bind_host = bind_host
        self.rows: dict[str, Row] = {}
        self.sequence = 0
        self.started = time.time()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._policies: dict[str, Any] = {}
        self._policy(placement)  # a placement name that does not load fails the start
        self._thread = threading.Thread(target=self._monitor, name="djinn-fleet-monitor")
        self._thread.daemon = True
        self._thread.start()

    # -- placement --------------------------------------------------------------------------
    def _policy(self, name: str) -> Any:
        policy = self._policies.get(name)
        if policy is None:
            from djinn.semantics.registry import default_registry

            policy = default_registry().placement(name)
            if policy is None:
                raise ValueError(f"no placement policy {name!r} (see `djinn plugins --check`)")
            self._policies[name] = policy
        return policy

    def set_placement(self, name: str) -> None:
        self._policy(name)
        self.placement = name

    def token(self) -> str:
        """The fleet's appliance token, for a client that has none configured. Anyone who
        can call this actor can already run code on every node of the cluster."""
        return self._token

    def place(
        self, model: str | None = None, exclude: list[str] | None = None, only: str | None = None
    ) -> dict[str, Any]:
        """The appliance a new session goes to: ``{id, endpoint, policy, sequence}``, or
        ``{error}`` when no appliance is live. ``only``: that appliance or none (a session
        pinned by its client)."""
        model = model[:12] if model else None
        now = time.time()
        with self._lock:
            live = [r for r in self.rows.values() if r.state == UP and r.id not in (exclude or ())]
            if only is not None:
                live = [r for r in live if r.id == only]
            if not live:
                states = ", ".join(f"{r.id}: {r.state}" for r in self.rows.values()) or "none"
                return {"error": f"no live appliance in the fleet ({states})"}
            facts = tuple(r.facts(now) for r in live)
            size = next((b for f in facts for fp, b in f.model_bytes if fp == model), 0)
            view = PlacementView(facts, model, size, self.sequence)
            try:
                chosen = self._policy(self.placement).choose(view)
            except Exception:  # a policy that raises is logged, and the first one used
                log.exception("placement policy %s failed", self.placement)
                chosen = ""
            row = self.rows.get(chosen) if chosen in {f.id for f in facts} else None
            row = row or live[0]
            self.sequence += 1
            row.placed += 1
            row.pending.append((now, None))
            if model:
                row.pending.append((now, model))
            return {
                "id": row.id,
                "endpoint": row.info["endpoint"],
                "node_id": row.node_id,
                "policy": self.placement,
                "sequence": self.sequence,
            }

    # -- what the fleet looks like ----------------------------------------------------------
    def states(self) -> dict[str, tuple[str, str]]:
        """``{id: (state, endpoint)}``: clients watch it for their appliances' deaths (an
        appliance restarted on its node comes back with the same id, another endpoint)."""
        with self._lock:
            return {r.id: (r.state, r.info.get("endpoint", "")) for r in self.rows.values()}

    def describe(self, appliance_id: str) -> dict[str, Any]:
        now = time.time()
        with self._lock:
            row = self.rows.get(appliance_id)
            return row.public(now) if row else {}

    def snapshot(self) -> dict[str, Any]:
        """The fleet document (``djinn status --fleet --json``)."""
        now = time.time()
        with self._lock:
            rows = [r.public(now) for r in sorted(self.rows.values(), key=lambda r: r.id)]
        live = [r for r in rows if r["state"] == UP]
        return {
            "schema": SCHEMA,
            "fleet": {
                "placement": self.placement,
                "report_interval_s": self.interval,
                "uptime_s": round(now - self.started, 3),
                "placements": self.sequence,
                "appliances": len(rows),
                "live": len(live),
                "free_bytes": sum(r.get("free_bytes", 0) for r in live),
                "weight_bytes": sum(m["bytes"] for r in live for m in r.get("models", [])),
            },
            "appliances": rows,
        }

    def shutdown(self) -> None:
        """Stop every appliance (SIGTERM: they drain) and the monitor."""
        self._stop.set()
        import ray

        with self._lock:
            rows = [r for r in self.rows.values() if r.state != DEAD]
        refs = [r.actor.stop.remote() for r in rows]
        ray.wait(refs, num_returns=len(refs), timeout=30)
        for r in rows:
            ray.kill(r.actor)

    # -- the monitor ------------------------------------------------------------------------
    def _monitor(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._reconcile()
                self._poll()
            except Exception:  # the directory outlives any one bad round
                log.exception("fleet monitor round failed")

    def _reconcile(self) -> None:
        import ray

        nodes = ray.nodes()
        offering = {
            n["NodeID"]: n
            for n in nodes
            if n.get("Alive") and n.get("Resources", {}).get(RESOURCE, 0) >= 1
        }
        now = time.time()
        with self._lock:
            for row in self.rows.values():
                if row.state != DEAD and row.node_id not in offering:
                    row.set_state(DEAD, "node died (Ray reports it dead)")
                    ray.kill(row.actor)
            covered = {r.node_id for r in self.rows.values() if r.state != DEAD}
            retry = {r.node_id for r in self.rows.values() if now - r.since < RETRY_AFTER_S}
            for node_id, node in offering.items():
                if node_id not in covered and node_id not in retry:
                    self._start(node_id, node)

    def _start(self, node_id: str, node: dict[str, Any]) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from .appliance_actor import ApplianceActor

        appliance_id = node_id[:8]
        gpus = int(node.get("Resources", {}).get("GPU", 0))
        actor = (
            ray.remote(ApplianceActor)
            .options(
                num_cpus=0,
                num_gpus=gpus,  # the appliance serves every GPU of its node
                resources={RESOURCE: 1},
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
                max_restarts=0,  # the directory starts a fresh one (it learns the new port)
                namespace=NAMESPACE,
            )
            .remote(appliance_id, self.settings, self._token, self.bind_host)
        )
        row = Row(appliance_id, node_id, actor, time.time())
        row.info_ref = actor.info.remote()
        self.rows[appliance_id] = row
        log.warning("starting appliance %s on node %s (%d GPUs)", appliance_id, node_id, gpus)

    def _poll(self) -> None:
        import ray

        with self._lock:
            starting = {r.info_ref: r for r in self.rows.values() if r.state == STARTING}
            live = [r for r in self.rows.values() if r.state in (UP, STALE)]
        if starting:
            done, _ = ray.wait(list(starting), num_returns=len(starting), timeout=0)
            for ref in done:
                row = starting[ref]
                try:
                    row.info = ray.get(ref)
                except Exception as exc:
                    with self._lock:
                        row.set_state(DEAD, f"did not start: {_short(exc)}")
                    ray.kill(row.actor)
                    continue
                with self._lock:
                    row.set_state(UP)
                    row.reported = 0.0
        refs = {r.actor.summary.remote(): r for r in live}
        if not refs:
            return
        done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=self.interval)
        now = time.time()
        for ref in done:
            row = refs[ref]
            try:
                summary = ray.get(ref)
            except Exception as exc:  # the actor died, or its djinn serve exited
                with self._lock:
                    row.set_state(DEAD, _short(exc))
                ray.kill(row.actor)
                continue
            with self._lock:
                row.summary, row.reported = summary, now
                if row.state == STALE:
                    row.set_state(UP)
        with self._lock:
            for row in live:
                silent = now - (row.reported or row.since)
                if row.state == UP and silent > STALE_AFTER_REPORTS * self.interval:
                    row.set_state(STALE, f"no report for {silent:.1f}s")


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1] if text else ''}"[:300]
