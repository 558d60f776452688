"""The admission queue (issue 9 §2, Note [admission queue]): a call that does not fit
even after eviction waits until memory is freed or its deadline passes."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.conftest import wait_for
from tests.integration.test_memory_pressure import MEMORY, _call, _gpt2

MIB = 1 << 20


def _crowd(client, s, model) -> tuple:
    """Register ``model``, then fill the device with another session's tensor so that
    the model (swapped out to make room for it) cannot come back."""
    from djinn.frontend import remote_module

    fp = remote_module.register(model, s)["fingerprint"]
    hog = client.session()
    blob = hog.put(torch.ones(3 * MIB))  # 12 MiB of session data: it never moves
    return fp, hog, blob


def test_a_call_that_cannot_fit_waits_for_memory_to_be_freed(fresh_appliance):
    app = fresh_appliance(cpu_worker_memory=MEMORY, admission_timeout=30.0)
    model = _gpt2(8)
    ids = torch.tensor([[1, 2, 3]])
    with app.connect() as client, client.session() as s:
        fp, hog, _blob = _crowd(client, s, model)

        def free_later() -> None:
            time.sleep(1.0)
            hog.close()  # its 12 MiB go: the waiting call fits now

        freer = threading.Thread(target=free_later)
        freer.start()
        got, _ = _call(s, fp, ids)  # parked until the hog leaves, then runs
        freer.join()
        with torch.no_grad():
            assert (got - model(ids).logits).abs().max().item() <= 1e-5
        queue = wait_for(
            lambda: (q := client.stats()["memory"][0]["admission"])["admitted_after_wait"] and q
        )
        assert queue["admitted_after_wait"] == 1 and queue["waiting"] == 0


def test_a_call_still_short_at_its_deadline_is_refused_saying_by_how_much(fresh_appliance):
    from djinn.errors import ResourceExhausted

    app = fresh_appliance(cpu_worker_memory=MEMORY, admission_timeout=30.0)
    with app.connect() as client, client.session() as s:
        fp, hog, _blob = _crowd(client, s, _gpt2(9))
        started = time.monotonic()
        with pytest.raises(ResourceExhausted, match=r"waited .* short by \d+ bytes"):
            _call(s, fp, torch.tensor([[1, 2, 3]]), admission_s=0.5)  # the call's own deadline
        assert time.monotonic() - started < 25  # its deadline, not the appliance's
        assert wait_for(lambda: client.stats()["memory"][0]["admission"]["timed_out"] == 1)
        hog.close()


def test_a_request_short_by_more_than_everything_held_is_refused_without_waiting(
    fresh_appliance,
):
    """No free could let it in: it waited out the whole deadline before."""
    from djinn.errors import ResourceExhausted

    app = fresh_appliance(cpu_worker_memory=MEMORY, admission_timeout=30.0)
    with app.connect() as client, client.session() as s:
        node = {"op": "aten::zeros.default", "args": [[1 << 30]]}
        with pytest.raises(ResourceExhausted) as err:
            s.execute([node], fetch=[{"$v": 0}])
        assert "admission queue" not in err.value.message
        assert client.stats()["memory"][0]["admission"]["timed_out"] == 0


def test_a_waiting_requests_inline_payload_stays_charged_while_it_waits(fresh_appliance):
    """Its input tensors sit in worker memory for as long as it waits: the stack pays for
    them until it is answered (they were uncharged once the first attempt returned)."""
    from djinn.protocol.tensors import to_wire

    app = fresh_appliance(cpu_worker_memory="48MiB", admission_timeout=30.0)
    payload = torch.ones(MIB)  # 4 MiB, inline in the EXEC frame
    big = {"op": "aten::zeros.default", "args": [[8 * MIB]]}  # 32 MiB: does not fit yet
    with app.connect() as client, client.session() as s:
        hog = client.session()
        blob = hog.put(torch.ones(6 * MIB))  # noqa: F841 - 24 MiB held, never moved
        nodes = [
            {"op": "aten::add.Tensor", "args": [{"$t": 0, "desc": to_wire(payload)[0]}, 1.0]},
            big,
            {"op": "aten::sum.default", "args": [{"$v": 1}]},
        ]
        fetch = [{"$v": 0}, {"$v": 2}]
        result: list = []
        runner = threading.Thread(
            target=lambda: result.append(s.execute(nodes, fetch=fetch, inline=[payload]))
        )
        runner.start()
        st = wait_for(lambda: (d := client.stats())["memory"][0]["admission"]["waiting"] and d)
        assert st["vmu"]["devices"][0]["stack"]["used"] >= payload.nbytes
        assert st["memory"][0]["admission"]["held_bytes"] >= payload.nbytes
        hog.close()  # room: it runs, and its payload's charge goes with its answer
        runner.join(60)
        (_, (out, zero)) = result[0]
        assert zero.item() == 0
        assert torch.equal(out, payload + 1)
        done = wait_for(
            lambda: (d := client.stats())["memory"][0]["admission"]["admitted_after_wait"] and d
        )
        assert done["memory"][0]["admission"]["held_bytes"] == 0
        assert done["vmu"]["devices"][0]["stack"]["used"] == 0
