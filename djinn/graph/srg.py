"""SRG data model and its versioned JSON export.

Vocabulary (DESIGN.md §5): phase, residency, modality, costs, module path. Capture builds
the graph with what it knows (ops, shapes, module paths, FLOPs and bytes, weights vs
activations vs gradients); semantic analysis fills in phase and modality later.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

SCHEMA = "djinn.srg/1"

PHASES = (
    "unknown",
    "forward",
    "llm_prefill",
    "llm_decode",
    "vision_encoding",
    "multimodal_fusion",
    "training",
)
RESIDENCIES = ("persistent_weight", "stateful_kv_cache", "ephemeral_activation", "gradient")
MODALITIES = ("text", "vision", "audio", "fusion")


@dataclass
class TensorMeta:
    dtype: str
    shape: list[int]
    bytes: int


@dataclass
class SRGNode:
    id: int
    op: str
    module: str = ""
    phase: str = "unknown"
    residency: str = "ephemeral_activation"
    modality: str | None = None
    outputs: list[TensorMeta] = field(default_factory=list)
    flops: int = 0
    bytes_read: int = 0
    bytes_written: int = 0

    @property
    def intensity(self) -> float:
        moved = self.bytes_read + self.bytes_written
        return self.flops / moved if moved else 0.0


@dataclass
class SRGInput:
    """A value the graph reads but did not compute: a weight, a kept handle, a constant."""

    id: str
    kind: str  # "weight" | "handle" | "constant"
    residency: str
    meta: TensorMeta


@dataclass
class SRGEdge:
    src: int | str  # node id, or an input id
    dst: int
    output: int
    meta: TensorMeta


@dataclass
class SRG:
    nodes: list[SRGNode] = field(default_factory=list)
    edges: list[SRGEdge] = field(default_factory=list)
    inputs: list[SRGInput] = field(default_factory=list)

    @property
    def total_flops(self) -> int:
        return sum(n.flops for n in self.nodes)

    def to_dict(self) -> dict[str, Any]:
        nodes = []
        for n in self.nodes:
            d = asdict(n)
            d["intensity"] = round(n.intensity, 4)
            nodes.append(d)
        return {
            "schema": SCHEMA,
            "nodes": nodes,
            "edges": [asdict(e) for e in self.edges],
            "inputs": [asdict(i) for i in self.inputs],
            "totals": {
                "nodes": len(self.nodes),
                "flops": self.total_flops,
                "bytes_read": sum(n.bytes_read for n in self.nodes),
                "bytes_written": sum(n.bytes_written for n in self.nodes),
            },
        }

    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.to_dict(), **kw)

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> SRG:
        if doc.get("schema") != SCHEMA:
            raise ValueError(f"unsupported SRG schema {doc.get('schema')!r}, expected {SCHEMA}")
        nodes = []
        for d in doc["nodes"]:
            d = {k: v for k, v in d.items() if k != "intensity"}
            d["outputs"] = [TensorMeta(**m) for m in d["outputs"]]
            nodes.append(SRGNode(**d))
        edges = [SRGEdge(**{**e, "meta": TensorMeta(**e["meta"])}) for e in doc["edges"]]
        inputs = [SRGInput(**{**i, "meta": TensorMeta(**i["meta"])}) for i in doc["inputs"]]
        return cls(nodes, edges, inputs)
