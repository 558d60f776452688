"""Workloads the scheduling benchmarks share: a training step's worth of op graph, and a
process that runs such graphs back to back."""

from __future__ import annotations

from typing import Any

import torch


def chain(handle: str, pairs: int) -> list[dict[str, Any]]:
    """An op graph of ``pairs`` matmul + tanh on one tensor: a training step's shape
    (long, op after op on the device), with no client-side work between the ops."""
    nodes: list[dict[str, Any]] = []
    for i in range(pairs):
        x = {"$h": handle} if i == 0 else {"$v": len(nodes) - 1}
        nodes.append({"op": "aten::mm.default", "args": [x, {"$h": handle}]})
        nodes.append({"op": "aten::tanh.default", "args": [{"$v": len(nodes) - 1}]})
    return nodes


def trainer(address: str, token: str, size: int, pairs: int, stop: Any, done: Any) -> None:
    """Run ``chain`` graphs on a ``size`` x ``size`` tensor back to back until ``stop``
    (a multiprocessing Event); counts them in ``done`` (a multiprocessing Value)."""
    from djinn.runtime.client import Client

    with Client(address, token or None) as client, client.session() as s:
        h = s.put(torch.randn(size, size) / size**0.5)
        nodes = chain(h.handle, pairs)
        while not stop.is_set():
            s.execute(nodes, fetch=[{"$v": len(nodes) - 1}])
            done.value += 1
