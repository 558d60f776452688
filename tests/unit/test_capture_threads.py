"""Note [a capturing client beside its worker]: a graph its client sent from this host
without waiting for it runs each op with one intra-op thread fewer than the worker has,
and every other request's ops (between two of its ops too) with all of them."""

from __future__ import annotations

import pytest
import torch

from djinn.appliance.executor import threads
from djinn.appliance.executor.graph import GraphRun
from djinn.appliance.vmu.device import DeviceVMU

CPU = torch.device("cpu")


@pytest.fixture
def two_threads(monkeypatch):
    """A worker of two threads with ``cpu_threads_beside_client = true``."""
    monkeypatch.setattr(threads, "beside_client", True)
    before = torch.get_num_threads()
    threads.configure(2)
    yield
    threads.configure(before)


@pytest.mark.parametrize(
    ("device", "same_host", "unwaited", "want"),
    [
        ("cpu", True, True, 1),  # sent without waiting: the client captures on
        ("cpu", True, False, None),  # the client waits for it: all of them
        ("cpu", False, True, None),  # over TCP: the client is elsewhere
        ("cuda", True, True, None),  # the kernels are not on the host's cores
    ],
)
def test_which_graphs_run_with_a_thread_fewer(two_threads, device, same_host, unwaited, want):
    assert threads.for_graph(device, same_host, unwaited) == want


def test_a_worker_of_one_thread_keeps_it(two_threads):
    threads.configure(1)
    assert threads.for_graph("cpu", True, True) is None


def test_the_setting_turns_it_off(two_threads, monkeypatch):
    monkeypatch.setattr(threads, "beside_client", False)
    assert threads.for_graph("cpu", True, True) is None


def test_the_fewer_threads_hold_for_the_graphs_ops_only(two_threads, monkeypatch):
    seen: list[int] = []
    real = GraphRun._node

    def node(self, i, n, last_use):
        seen.append(torch.get_num_threads())
        return real(self, i, n, last_use)

    monkeypatch.setattr(GraphRun, "_node", node)
    x = torch.arange(6.0)
    body = {
        "nodes": [
            {"op": "aten::mul.Tensor", "args": [{"$h": "x"}, {"$h": "x"}]},
            {"op": "aten::add.Tensor", "args": [{"$v": 0}, {"$h": "x"}]},
        ],
        "keep": [{"$v": 1}],
        "fetch": [],
        "partial": True,
    }
    stack = DeviceVMU(1 << 30, 0, 0).segments["stack"]
    run = GraphRun(body, {"x": x}.__getitem__, [], CPU, stack)
    run.threads = threads.for_graph("cpu", True, True)
    steps = run.steps()
    next(steps)  # the first op ran; another request's op may run now
    assert torch.get_num_threads() == 2
    with pytest.raises(StopIteration) as done:
        next(steps)
    keep, _fetch = done.value.value
    assert seen == [1, 1] and torch.get_num_threads() == 2
    assert torch.equal(keep[0], x * x + x)
