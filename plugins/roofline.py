"""Roofline cost model: each op takes max(FLOPs / peak FLOP/s, bytes / peak bandwidth)."""

from __future__ import annotations

from djinn.graph.srg import SRG
from djinn.semantics.protocols import CostEstimate, DeviceSpec


class RooflineCostModel:
    name = "roofline"

    def estimate(self, graph: SRG, device: DeviceSpec) -> CostEstimate:
        per_node, compute, memory = {}, 0.0, 0.0
        for n in graph.nodes:
            c = n.flops / device.peak_flops
            m = (n.bytes_read + n.bytes_written) / device.peak_bytes
            per_node[n.id] = max(c, m)
            compute += c
            memory += m
        return CostEstimate(
            self.name,
            sum(per_node.values()),
            graph.total_flops,
            sum(n.bytes_read + n.bytes_written for n in graph.nodes),
            "compute" if compute >= memory else "memory",
            per_node,
        )
