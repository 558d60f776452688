"""Session tensors between the device and the host tier (issue 9 §2, Note [session
tensors on the host]): an idle session's tensors make room for another session's work,
and come back bit-identical when that session uses them again, under each policy."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import wait_for
from tests.integration.test_memory_pressure import MEMORY, POLICIES, _call, _gpt2

MIB = 1 << 20


def _row(client, sid: str) -> dict:
    return next(r for r in client.stats()["sessions"] if r["id"] == sid)


@pytest.mark.parametrize("policy", POLICIES)
def test_an_idle_sessions_tensors_go_to_the_host_and_come_back_bit_identical(
    fresh_appliance, policy
):
    from djinn.frontend import remote_module

    app = fresh_appliance(cpu_worker_memory=MEMORY, memory_policy=policy)
    x = torch.randn(3 * MIB // 2, generator=torch.Generator().manual_seed(0))  # 6 MiB
    with app.connect() as client, client.session() as idle, client.session() as busy:
        rx = idle.put(x)  # an arena slab: never moves on a CPU worker
        (y, z, gone), _ = idle.execute(
            [
                {"op": "aten::add.Tensor", "args": [rx.ref(), rx.ref()]},
                {"op": "aten::mul.Scalar", "args": [{"$v": 0}, 3.0]},
                {"op": "aten::neg.default", "args": [{"$v": 0}]},
            ],
            keep=[{"$v": 0}, {"$v": 1}, {"$v": 2}],
        )  # 18 MiB of graph outputs, movable
        idle.free([rx.handle])
        # another session's model does not fit beside them: the idle tensors make room
        model = _gpt2(11)
        fp = remote_module.register(model, busy)["fingerprint"]
        ids = torch.tensor([[5, 6, 7]])
        got, _ = _call(busy, fp, ids)
        with torch.no_grad():
            assert (got - model(ids).logits).abs().max().item() <= 1e-5
        row = wait_for(lambda: (r := _row(client, idle.id))["host_bytes"] > 0 and r)
        assert row["swaps_out"] >= 1
        idle.free([gone.handle])  # freed while on the host: its slab goes, nothing moves
        wait_for(lambda: _row(client, idle.id)["host_bytes"] == 2 * 6 * MIB)
        # used again: they come back, bit for bit, into a graph and a read
        _, (total,) = idle.execute(
            [{"op": "aten::add.Tensor", "args": [y.ref(), z.ref()]}], fetch=[{"$v": 0}]
        )
        assert torch.equal(total, (x + x) + (x + x) * 3.0)
        assert torch.equal(y.cpu(), x + x)
        row = wait_for(lambda: (r := _row(client, idle.id))["host_bytes"] == 0 and r)
        assert row["swaps_in"] >= 1
        vmu = client.stats()["vmu"]["devices"][0]
        assert vmu["peak"] <= vmu["capacity"]
