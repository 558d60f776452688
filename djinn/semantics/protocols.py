"""The plugin contracts: a pattern recognises structure in an SRG; a cost model prices it.

A plugin is a class named by an entry point; Djinn instantiates it with no arguments.
Both protocols are runtime-checkable, so a plugin only has to have the right shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from djinn.graph.srg import SRG


@dataclass
class AnalysisContext:
    """What the caller knows beyond the graph: the inputs and whether a KV cache came in."""

    input_shapes: dict[str, list[int]] = field(default_factory=dict)
    input_dtypes: dict[str, str] = field(default_factory=dict)
    has_kv_cache: bool = False
    module_class: str = ""


@dataclass
class PatternMatch:
    pattern: str
    confidence: float  # 0..1; the analysis keeps the most confident phase
    phase: str | None = None
    modality: str | None = None
    node_ids: list[int] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class PatternPlugin(Protocol):
    name: str

    def match(self, graph: SRG, ctx: AnalysisContext) -> PatternMatch | None:
        """Return a match if the graph has this structure, else None. Must not raise for
        graphs it does not understand."""


@dataclass
class DeviceSpec:
    name: str = "cpu"
    peak_flops: float = 1e11  # FLOP/s
    peak_bytes: float = 2e10  # B/s of memory bandwidth


@dataclass
class CostEstimate:
    model: str
    seconds: float
    flops: int
    bytes: int
    bound: str  # "compute" | "memory"
    per_node: dict[int, float] = field(default_factory=dict)


@runtime_checkable
class CostModel(Protocol):
    name: str

    def estimate(self, graph: SRG, device: DeviceSpec) -> CostEstimate:
        """Estimate the time of running ``graph`` on ``device``."""
