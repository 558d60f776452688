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
