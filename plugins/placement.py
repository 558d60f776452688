"""Built-in fleet placement policies (entry point group ``djinn.placement``).

``semantic`` (the default) places a session by the model it registers: where the model
already is, else where a new model fits best. ``round_robin`` takes the appliances in
turn; it is the comparison ``benchmarks/fleet.py`` measures ``semantic`` against (it
ends up holding a copy of every model on every appliance).
"""

from __future__ import annotations

import statistics

from djinn.semantics.placement import ApplianceFacts, PlacementView

# Free memory is compared in steps of this share of the largest appliance, so that a few
# MiB of difference between two empty appliances do not outweigh their load.
FREE_STEPS = 64


class RoundRobinPlacement:
    """Each placement goes to the next live appliance, whatever it holds."""

    name = "round_robin"

    def choose(self, view: PlacementView) -> str:
        apps = sorted(view.appliances, key=lambda a: a.id)
        return apps[view.sequence % len(apps)].id


class SemanticPlacement:
    """Note [semantic placement]: weights are what is expensive to move, so the model a
    session registers decides where it goes.

    1. A model some appliance holds (resident on its device or host tier, or placed there
       moments ago and still uploading): go there, so the fleet keeps one copy of its
       weights and the session's KV caches sit beside them. Among several holders, the
       least loaded per worker.
    2. A model no appliance holds: the appliance with the most free device memory after
       the models placed there but not reported yet (each counted at the size of a typical
       model in the fleet), then the one holding fewer models, then the least loaded.
       Appliances the model would not fit in are considered only if none fits.
    3. A session that names no model: the least loaded appliance per worker, then the one
       with the most free memory.
    """

    name = "semantic"

    def choose(self, view: PlacementView) -> str:
        apps = view.appliances
        if view.model:
            holders = [a for a in apps if view.model in a.models | a.pending_models]
            if holders:
                return min(holders, key=lambda a: (a.load / a.workers, -a.free_bytes, a.id)).id
            typical = _typical_model_bytes(apps)
            need = view.model_bytes or typical
            step = max(max(a.capacity_bytes for a in apps) // FREE_STEPS, 1)

            def free_after(a: ApplianceFacts) -> int:
                return a.free_bytes - typical * len(a.pending_models - a.models)

            fits = [a for a in apps if free_after(a) >= need] or list(apps)
            return min(
                fits,
                key=lambda a: (
                    -(free_after(a) // step),
                    len(a.models | a.pending_models),
                    a.load / a.workers,
                    a.id,
                ),
            ).id
        step = max(max(a.capacity_bytes for a in apps) // FREE_STEPS, 1)
        return min(apps, key=lambda a: (a.load / a.workers, -(a.free_bytes // step), a.id)).id


def _typical_model_bytes(apps: tuple[ApplianceFacts, ...]) -> int:
    sizes = [b for a in apps for _, b in a.model_bytes]
    return int(statistics.median(sizes)) if sizes else 0
