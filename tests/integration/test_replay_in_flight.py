"""Note [asynchronous replays] (djinn/frontend/replay_run.py): a replay sends its graph and
returns; its outputs land with the reply, its failure fails what it made and what it
wrote, and a worker lost while it is in flight is recovered as for any graph."""

from __future__ import annotations

import copy
import os
import signal
import threading
import time

import pytest
import torch

import djinn
from djinn.errors import DjinnError
from djinn.frontend.nodes import Pending, Replayed
from djinn.frontend.session import default_session
from djinn.runtime import flights
from djinn.runtime.session import Session
from tests.conftest import wait_for

R = "remote_accelerator:0"


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def _replaying(fn, *args):
    """``fn`` made replayable and called until its next call replays."""
    f = djinn.replayable(fn)
    for _ in range(2):
        f(*args)
    return f


def test_a_replay_returns_before_its_graph_has_run(remote, monkeypatch):
    local = _mlp().eval()
    model = copy.deepcopy(local).to(remote)
    x = torch.randn(3, 8)
    rx = x.to(remote)
    with torch.no_grad():
        fwd = _replaying(lambda t: model(t), rx)
        sent = []
        real = Session.run_graph_async

        def counting(self, *args, **kwargs):
            sent.append(kwargs.get("partial", True))
            return real(self, *args, **kwargs)

        def waiting(*_a, **_k):
            raise AssertionError("a replay waited for its graph")

        monkeypatch.setattr(Session, "run_graph_async", counting)
        monkeypatch.setattr(Session, "execute", waiting)
        monkeypatch.setattr(Session, "run_graph", waiting)
        out = fwd(rx)
        assert fwd.stats()["replays"] == 1
        assert sent == [False]  # one request, not partial: a failing node fails it whole
        ref = out._ref
        assert isinstance(ref, Pending) and isinstance(ref.node, Replayed)
        assert ref.node.inflight is not None  # its reply is not read yet
        monkeypatch.undo()
        assert torch.equal(out.cpu(), local(x))  # lands, then reads
        assert not isinstance(out._ref, Pending)


def test_a_replay_that_fails_in_flight_fails_its_outputs_and_what_it_writes(remote):
    """The graph fails on the appliance (an index out of range, seen by the kernel only):
    the error is raised where the replay lands, its output raises it, and so does the
    tensor it writes into in place, which must not be read as if it held the program's
    value; a tensor it only reads is intact."""
    table = torch.arange(12.0).reshape(6, 2)
    rtable = table.to(remote)
    acc = torch.zeros(6, 2)
    racc = acc.to(remote)
    ones = torch.ones(3, 2).to(remote)

    def step(idx):
        racc.index_add_(0, idx, ones)
        return (racc * rtable).sum(dim=1)

    good = torch.tensor([0, 5, 2])
    f = _replaying(step, good.to(R))
    for _ in range(2):
        acc.index_add_(0, good, torch.ones(3, 2))
    out = f(good.to(R))
    acc.index_add_(0, good, torch.ones(3, 2))
    assert f.stats()["replays"] == 1
    assert torch.equal(out.cpu(), (acc * table).sum(dim=1))
    bad = f(torch.tensor([0, 9, 2]).to(R))  # row 9 of 6: returns, the graph is in flight
    assert f.stats()["replays"] == 2
    with pytest.raises(DjinnError, match="index"):
        bad.cpu()
    with pytest.raises(DjinnError, match="index"):
        bad.cpu()  # a failed value stays failed
    with pytest.raises(DjinnError, match="index"):
        racc.cpu()
    assert torch.equal(rtable.cpu(), table)


def test_a_worker_lost_with_a_replay_in_flight_is_recovered(own_frontend):
    """The replay goes to a worker that died: its reply, read when it lands, says so, the
    session is rebuilt and the replay sent again, and the outputs are what a run gives."""
    w = torch.randn(4, 4)
    rw = w.to(R)
    f = djinn.replayable(lambda t: (t @ rw).relu())
    x = torch.randn(2, 4)
    rx = x.to(R)
    for _ in range(2):
        assert torch.equal(f(rx).cpu(), (x @ w).relu())
    s = default_session()
    pid = next(w["pid"] for w in own_frontend.stats()["workers"] if w["id"] == s.worker)
    os.kill(pid, signal.SIGKILL)
    wait_for(
        lambda: all(w["pid"] != pid or not w["alive"] for w in own_frontend.stats()["workers"])
    )
    out = f(rx)
    assert f.stats()["replays"] == 1
    assert torch.equal(out.cpu(), (x @ w).relu())
    assert s.recovery_stats()["recoveries"] == 1
    assert torch.equal(f(rx).cpu(), (x @ w).relu())


def test_a_replay_another_thread_is_landing_is_read_once_it_has_landed(remote, monkeypatch):
    """Thread B lands the replay (its next request reads the reply first) while the caller
    reads the output: the caller waits for B's landing and reads the value. (A review
    found the caller taking the output for one of another trace's: the landing had said
    it was no longer in flight before it had read the reply.)"""
    w = torch.randn(16, 16)
    rw = w.to(R)
    x = torch.randn(4, 16)
    rx = x.to(R)
    f = _replaying(lambda t: (t @ rw).tanh(), rx)
    landing = threading.Event()
    real = flights.Flight.outcome

    def slow(self):
        landing.set()
        time.sleep(0.3)  # a slow reply: the caller reads while B is still landing
        return real(self)

    monkeypatch.setattr(flights.Flight, "outcome", slow)
    out = f(rx)
    assert f.stats()["replays"] == 1
    other = torch.ones(2).to(R)
    got = []
    b = threading.Thread(target=lambda: got.append((other + 1).cpu()))
    b.start()
    assert landing.wait(10)
    assert torch.equal(out.cpu(), (x @ w).tanh())
    b.join(10)
    assert torch.equal(got[0], torch.full((2,), 2.0))
