"""Starting and finding a fleet on Ray: the commands behind `djinn fleet`.

A node that should run an appliance offers one unit of the ``djinn_appliance`` resource
(``ray start ... --resources '{"djinn_appliance": 1}'``); the directory starts an
appliance on every such node, including nodes that join later. The directory is a
detached named actor, so `djinn fleet start` can exit and the fleet lives on until
`djinn fleet stop` (or the cluster stops).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from typing import Any

from djinn.errors import ConfigError, Unavailable

from .directory import DIRECTORY_NAME, NAMESPACE, RESOURCE, UP, FleetDirectory

# Settings of the appliances that are the fleet's, not any one appliance's: they stay out
# of what the directory hands each appliance (client-side settings are harmless there).
FLEET_ONLY = ("fleet_placement", "fleet_report_interval", "fleet_appliance_host")


def connect_ray(address: str) -> None:
    """Join the Ray cluster at ``address`` as a driver (``auto``, ``host:port``, or a
    Ray Client ``ray://host:port``); a process already connected stays connected."""
    try:
        import ray
    except ImportError:
        raise ConfigError(
            "a fleet address needs Ray: pip install 'djinn[fleet]' (ray[client])"
        ) from None
    if ray.is_initialized():
        return
    try:
        ray.init(
            address=address,
            namespace=NAMESPACE,
            log_to_driver=False,
            logging_level=logging.WARNING,
        )
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise Unavailable(f"cannot reach the Ray cluster at {address}: {exc}") from None


def get_directory() -> Any:
    import ray

    try:
        return ray.get_actor(DIRECTORY_NAME, namespace=NAMESPACE)
    except ValueError:
        raise Unavailable(
            "the Ray cluster runs no Djinn fleet directory: start one with `djinn fleet start`"
        ) from None


def start_directory(settings: dict[str, Any], token: str, *, detached: bool = True) -> Any:
    """The fleet directory actor, started with ``settings`` (a ``Config``'s values)."""
    import ray

    appliance_settings = {k: v for k, v in settings.items() if k not in FLEET_ONLY}
    options: dict[str, Any] = {
        "name": DIRECTORY_NAME,
        "namespace": NAMESPACE,
        "num_cpus": 0,
        "max_concurrency": 16,  # place() and snapshot() run beside the monitor thread
        "max_restarts": 0,
    }
    if detached:
        options["lifetime"] = "detached"
    # on the node that starts it (the head, for `djinn fleet start`), never left to the
    # scheduler: an appliance node that dies must not take the fleet's directory with it
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(here, soft=False)
    actor = (
        ray.remote(FleetDirectory)
        .options(**options)
        .remote(
            appliance_settings,
            token,
            settings.get("fleet_placement", "semantic"),
            settings.get("fleet_report_interval", 0.5),
            settings.get("fleet_appliance_host", ""),
        )
    )
    ray.get(actor.states.remote())  # surfaces a constructor error (a bad placement name)
    return actor


def stop_directory(directory: Any) -> None:
    import ray

    ray.get(directory.shutdown.remote(), timeout=60)
    ray.kill(directory)


def wait_live(directory: Any, count: int, timeout: float = 120.0) -> dict[str, Any]:
    """Wait until ``count`` appliances are up; the fleet document then."""
    import ray

    deadline = time.monotonic() + timeout
    while True:
        doc = ray.get(directory.snapshot.remote())
        if sum(1 for a in doc["appliances"] if a["state"] == UP and a.get("workers_up")) >= count:
            return doc
        if time.monotonic() > deadline:
            states = {a["id"]: f"{a['state']} {a['why']}" for a in doc["appliances"]}
            raise Unavailable(f"{count} appliances not up after {timeout:.0f}s: {states}")
        time.sleep(0.2)


def ray_start(
    *,
    head: bool,
    address: str = "",
    port: int = 6379,
    appliance: bool = True,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    extra: tuple[str, ...] = (),
) -> int:
    """Run ``ray start`` on this node, offering the appliance resource unless told not to."""
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start"]
    cmd += ["--head", f"--port={port}"] if head else [f"--address={address}"]
    if appliance:
        cmd.append("--resources=" + json.dumps({RESOURCE: 1}))
    if num_cpus is not None:
        cmd.append(f"--num-cpus={num_cpus}")
    if num_gpus is not None:
        cmd.append(f"--num-gpus={num_gpus}")
    cmd += list(extra)
    return subprocess.run(cmd, check=False).returncode
