"""Quickstart: move a tensor to the appliance, compute there, read the result back.

Run it with no appliance configured and Djinn starts an embedded one for this process
(stopped when the script exits). Point it at a running appliance with
``DJINN_ADDRESS=unix:///tmp/djinn-$UID.sock`` or ``tcp://host:7711`` plus ``DJINN_TOKEN``.
"""

from __future__ import annotations

import time

import torch

import djinn
from djinn.cli.status import human_bytes


def main() -> None:
    t0 = time.perf_counter()
    client = djinn.connect()
    print(f"connected to {client.address} in {time.perf_counter() - t0:.1f}s")
    with client.session() as s:
        x = torch.randn(2048, 2048)
        w = torch.randn(2048, 512)
        rx, rw = s.put_many([x, w])  # bulk bytes go through the shared-memory arena
        print(f"put {human_bytes(x.nbytes + w.nbytes)} -> {rx}, {rw}")
        assert torch.equal(rx.cpu(), x)

        # A small graph of aten ops, executed on the appliance's worker.
        (y,), (norm,) = s.execute(
            [
                {"op": "aten::mm.default", "args": [rx.ref(), rw.ref()]},
                {"op": "aten::relu.default", "args": [{"$v": 0}]},
                {"op": "aten::linalg_vector_norm.default", "args": [{"$v": 1}]},
            ],
            keep=[{"$v": 1}],
            fetch=[{"$v": 2}],
        )
        local = torch.relu(x @ w)
        diff = (y.cpu() - local).abs().max().item()
        print(f"relu(x @ w) on the appliance: {y}; max |remote - local| = {diff:.2e}")
        print(f"norm: remote {norm.item():.4f}, local {local.norm().item():.4f}")

        st = client.stats()
        arena = st["vmu"]["host_arena"]
        print(
            f"workers: {[w['device'] for w in st['workers']]}, sessions: {len(st['sessions'])}, "
            f"host arena {human_bytes(arena['used'])} / {human_bytes(arena['capacity'])}"
        )
    client.close()


if __name__ == "__main__":
    main()
