"""Note [rerunnable graphs]: an op graph short of device memory may wait in the admission
queue and run again from its first op only if no op before the short one wrote in place;
otherwise running it again would apply those writes twice (a silent wrong number)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from djinn.errors import ResourceExhausted

MIB = 1 << 20
BIG = {"op": "aten::zeros.default", "args": [[8 * MIB]]}  # 32 MiB of float32


def test_a_graph_that_wrote_in_place_is_refused_at_once_and_wrote_once(fresh_appliance):
    app = fresh_appliance(cpu_worker_memory="48MiB", admission_timeout=30.0)
    with app.connect() as client, client.session() as s, client.session() as hog:
        hog.put(torch.ones(6 * MIB))  # 24 MiB of session data: it never moves
        h = s.put(torch.zeros(4))
        started = time.monotonic()
        with pytest.raises(ResourceExhausted, match="not queued"):
            s.execute([{"op": "aten::add_.Scalar", "args": [{"$h": h.handle}, 1.0]}, BIG])
        assert time.monotonic() - started < 20  # refused, not left waiting for 30 s
        assert torch.equal(h.cpu(), torch.ones(4))


def test_a_graph_that_wrote_nothing_yet_waits_and_runs_once(fresh_appliance):
    app = fresh_appliance(cpu_worker_memory="48MiB", admission_timeout=30.0)
    with app.connect() as client, client.session() as s:
        hog = client.session()
        hog.put(torch.ones(6 * MIB))
        h = s.put(torch.zeros(4))
        freer = threading.Timer(1.0, hog.close)  # its 24 MiB go: the graph fits then
        freer.start()
        nodes = [BIG, {"op": "aten::add_.Scalar", "args": [{"$h": h.handle}, 1.0]}]
        s.execute(nodes)  # parked until the hog leaves, then run from its first op
        freer.join()
        assert torch.equal(h.cpu(), torch.ones(4))


def test_an_op_charged_after_it_ran_does_not_requeue_a_graph_that_wrote(fresh_appliance):
    """``nonzero`` has no meta kernel: its output is charged after it ran. A graph whose
    earlier op wrote in place must not be queued and run again from there either."""
    app = fresh_appliance(cpu_worker_memory="16MiB", admission_timeout=30.0)
    with app.connect() as client, client.session() as s:
        hog = client.session()
        h = s.put(torch.zeros(4))
        big = s.put(torch.ones(MIB))  # nonzero() of it: 8 MiB of int64
        hog.put(torch.ones(2 * MIB))  # 8 MiB that never moves
        freer = threading.Timer(1.5, hog.close)
        freer.start()
        nodes = [
            {"op": "aten::add_.Scalar", "args": [{"$h": h.handle}, 1.0]},
            {"op": "aten::nonzero.default", "args": [{"$h": big.handle}]},
        ]
        with pytest.raises(ResourceExhausted, match="not queued"):
            s.execute(nodes)
        freer.join()
        assert torch.equal(h.cpu(), torch.ones(4))
