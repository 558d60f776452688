"""Finding plugins through entry points, and loading them safely.

Listing reads only distribution metadata (``importlib.metadata``): nothing is imported.
Loading imports each plugin on first use; one that fails to import, or whose class does
not fit its Protocol, is reported (a warning and an entry in ``broken``) and skipped,
never fatal.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import warnings
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

from .memory import MemoryPolicy
from .placement import PlacementPolicy
from .protocols import CostModel, PatternPlugin
from .scheduling import SchedulerPolicy

log = logging.getLogger("djinn.semantics.registry")

GROUPS = {
    "patterns": "djinn.patterns",
    "cost_models": "djinn.cost_models",
    "memory_policies": "djinn.memory_policies",
    "schedulers": "djinn.schedulers",
    "placement": "djinn.placement",
}
_PROTOCOLS = {
    "patterns": PatternPlugin,
    "cost_models": CostModel,
    "memory_policies": MemoryPolicy,
    "schedulers": SchedulerPolicy,
    "placement": PlacementPolicy,
}


@dataclass(frozen=True)
class PluginInfo:
    group: str
    name: str
    target: str  # "module:Class"
    distribution: str


def list_plugins() -> list[PluginInfo]:
    """Every registered plugin, from metadata only (no import)."""
    out = []
    for kind, group in GROUPS.items():
        for ep in entry_points(group=group):
            dist = getattr(ep, "dist", None)
            out.append(PluginInfo(kind, ep.name, ep.value, dist.name if dist else "?"))
    return sorted(out, key=lambda p: (p.group, p.name))


class Registry:
    def __init__(self) -> None:
        self._loaded: dict[str, list[Any]] = {}
        self.broken: dict[str, str] = {}  # "group:name" -> why
        self._lock = threading.Lock()

    def load(self, kind: str) -> list[Any]:
        with self._lock:
            if kind not in self._loaded:
                self._loaded[kind] = self._load(kind)
            return self._loaded[kind]

    def _load(self, kind: str) -> list[Any]:
        plugins = []
        for ep in sorted(entry_points(group=GROUPS[kind]), key=lambda e: e.name):
            key = f"{GROUPS[kind]}:{ep.name}"
            try:
                plugin = ep.load()()
                if not isinstance(plugin, _PROTOCOLS[kind]):
                    raise TypeError(f"{ep.value} does not implement {_PROTOCOLS[kind].__name__}")
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # even SystemExit: a plugin never takes Djinn down
                self.broken[key] = f"{type(exc).__name__}: {exc}"
                log.warning("skipping plugin %s: %s", key, exc)
                # under -W error a warning raises: it must not become fatal either
                with contextlib.suppress(Exception):
                    warnings.warn(
                        f"djinn: skipping plugin {key} ({ep.value}): {exc}",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                continue
            plugins.append(plugin)
        return plugins

    def patterns(self) -> list[PatternPlugin]:
        return self.load("patterns")

    def cost_models(self) -> list[CostModel]:
        return self.load("cost_models")

    def memory_policy(self, name: str) -> MemoryPolicy | None:
        """The memory policy called ``name`` (None for 'off', or if it failed to load)."""
        return next((p for p in self.load("memory_policies") if p.name == name), None)

    def scheduler(self, name: str) -> SchedulerPolicy | None:
        """The scheduling policy called ``name`` (None if it failed to load)."""
        return next((p for p in self.load("schedulers") if p.name == name), None)

    def placement(self, name: str) -> PlacementPolicy | None:
        """The fleet placement policy called ``name`` (None if it failed to load)."""
        return next((p for p in self.load("placement") if p.name == name), None)


_default: Registry | None = None


def default_registry() -> Registry:
    global _default
    if _default is None:
        _default = Registry()
    return _default
