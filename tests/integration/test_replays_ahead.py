"""Note [replays sent ahead] (djinn/runtime/flights.py): with ``replay_ahead``, a replay
goes while the graph before it still runs. The worker runs it only if that one ran
(``after``, BEHIND_FAILED); the results are eager's; a failure is raised once, a call
later, and what the replay behind it made holds it; a worker lost with both in flight is
recovered and both are sent again, in order."""

from __future__ import annotations

import copy
import os
import signal

import pytest
import torch

import djinn
from djinn.errors import DjinnError
from djinn.frontend.session import default_session
from djinn.protocol.frames import Kind
from djinn.runtime.session import Session
from tests.conftest import wait_for
from tests.integration.test_followed_steps import _step_of
from tests.integration.test_replay_in_flight import _mlp

R = "remote_accelerator:0"


@pytest.fixture
def behind(monkeypatch):
    """Replays sent ahead whatever the host (this CI's 2 cores say never by ``auto``), and
    for each graph sent, whether it went behind another."""
    monkeypatch.setattr(default_session().client, "replay_ahead", "always")
    went: list[bool] = []
    real = Session.run_graph_async

    def sending(self, *args, **kwargs):
        f = real(self, *args, **kwargs)
        went.append(f.behind is not None)
        return f

    monkeypatch.setattr(Session, "run_graph_async", sending)
    return went


def test_a_training_loop_sent_ahead_ends_with_eagers_parameters(remote, behind):
    local = _mlp()
    model = copy.deepcopy(local).to(remote)
    local_opt = torch.optim.SGD(local.parameters(), lr=0.05, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(3)
    batches = [(torch.randn(5, 8, generator=gen), torch.randn(5, 4, generator=gen))
               for _ in range(8)]  # fmt: skip
    step = djinn.replayable(_step_of(model, opt))
    eager = _step_of(local, local_opt)
    losses = []
    channel = default_session().channel
    beats = channel.sent_by_kind[Kind.HEARTBEAT]
    for x, y in batches:
        losses.append((step(x.to(remote), y.to(remote)), eager(x, y)))
    # two calls record, and the first step's momentum buffers change what the next reads
    assert step.stats()["replays"] == 5
    # every replay after the first went behind the one before, but where a heartbeat
    # landed the one before first (Note [a beat after a flight]: a loaded host, a CI
    # rehearsal's 2 of 4, my reading: it stalled half a second between steps); each
    # lands at most one
    beats = channel.sent_by_kind[Kind.HEARTBEAT] - beats
    assert sum(behind) >= max(4 - beats, 1), (behind, beats)
    for got, want in losses:
        assert torch.equal(got.cpu(), want)
    for p, q in zip(model.parameters(), local.parameters(), strict=True):
        assert torch.equal(p.detach().cpu(), q.detach())


def test_a_default_adam_loop_sent_ahead_ends_with_eagers_parameters(remote, behind, ahead):
    """Its steps followed (Note [followed steps]), each way (``ahead``: the split replay
    first, or the whole recording after the following): the call's first graph goes
    behind the last call's, while its steps are followed, and the loop is eager's, bit
    for bit."""
    local = _mlp()
    model = copy.deepcopy(local).to(remote)
    local_opt = torch.optim.Adam(local.parameters(), lr=1e-2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(4)
    batches = [(torch.randn(5, 8, generator=gen), torch.randn(5, 4, generator=gen))
               for _ in range(8)]  # fmt: skip
    step = djinn.replayable(_step_of(model, opt))
    eager = _step_of(local, local_opt)
    losses = [(step(x.to(remote), y.to(remote)), eager(x, y)) for x, y in batches]
    stats = step.stats()
    assert stats["steps_followed"] >= 5 and stats["steps_captured"] == {}, stats
    # went behind another: how many depends on timing (a heartbeat on a loaded host may
    # land the last call's graph first; a CI rehearsal read 3 of the usual 4 or more)
    assert any(behind), behind
    for got, want in losses:
        assert torch.equal(got.cpu(), want)
    for p, q in zip(model.parameters(), local.parameters(), strict=True):
        assert torch.equal(p.detach().cpu(), q.detach())


def test_a_replay_reading_what_the_one_in_flight_made_lands_it_first(remote, behind):
    """A recurrence: each call reads the last call's output, which the replay in flight
    makes; it lands that one and replays (no new recording), with eager's numbers."""
    w = torch.randn(6, 6) / 3
    rw = w.to(remote)
    f = djinn.replayable(lambda h: torch.tanh(h @ rw))
    h, rh = torch.randn(2, 6), None
    rh = h.to(remote)
    for _ in range(6):
        h, rh = torch.tanh(h @ w), f(rh)
    assert f.stats()["replays"] == 4 and f.stats()["recordings"] == 2
    assert torch.equal(rh.cpu(), h)


def test_a_replay_sent_behind_one_that_fails_is_not_run_and_holds_its_error(remote, behind):
    """The first replay fails on the worker (an index out of range, seen by the kernel
    only); the second, sent behind it, is not run: the tensor both write into is not
    written twice. The first's error is raised once, where it lands; the second's output
    holds an error naming it, and is not raised at its landing."""
    table = torch.arange(12.0).reshape(6, 2)
    rtable = table.to(remote)
    racc = torch.zeros(6, 2).to(remote)
    ones = torch.ones(3, 2).to(remote)

    def step(idx):
        racc.index_add_(0, idx, ones)
        return (racc * rtable).sum(dim=1)

    good = torch.tensor([0, 5, 2]).to(R)
    f = djinn.replayable(step)
    for _ in range(3):
        f(good)
    bad = f(torch.tensor([0, 9, 2]).to(R))  # row 9 of 6
    after = f(good)  # sent behind the failing one
    assert f.stats()["replays"] == 3
    assert behind[-1] is True
    with pytest.raises(DjinnError, match="index") as first:
        after.cpu()  # lands the failed replay first: its error, on this thread
    assert "not run" not in str(first.value)
    with pytest.raises(DjinnError, match="not run: the graph sent before it failed") as second:
        after.cpu()
    assert "index" in str(second.value)
    with pytest.raises(DjinnError, match="index"):
        bad.cpu()
    with pytest.raises(DjinnError):
        racc.cpu()
    assert torch.equal(rtable.cpu(), table)


def test_the_worker_refuses_a_graph_sent_behind_a_failed_request(remote):
    """The protocol's part: ``after`` naming a failed EXEC of the session gets
    BEHIND_FAILED and runs nothing; naming one that ran, it runs; a malformed one is an
    INVALID_ARGUMENT."""
    s = default_session()
    trace_free = torch.ones(2).to(remote)  # a session with a live handle
    assert torch.equal(trace_free.cpu(), torch.ones(2))
    ch = s.channel
    s._settle()
    failed = ch.send(Kind.EXEC, {"nodes": [{"op": "aten::no_such_op"}], "keep": [], "fetch": []})
    with pytest.raises(DjinnError) as refused:
        ch.receive(failed)
    assert refused.value.code != "BEHIND_FAILED"
    behind = ch.send(Kind.EXEC, {"nodes": [], "keep": [], "fetch": [], "after": failed})
    with pytest.raises(DjinnError, match="not run: request") as skipped:
        ch.receive(behind)
    assert skipped.value.code == "BEHIND_FAILED"
    ran = ch.send(Kind.EXEC, {"nodes": [], "keep": [], "fetch": []})
    ch.receive(ran)
    fine = ch.send(Kind.EXEC, {"nodes": [], "keep": [], "fetch": [], "after": ran})
    assert ch.receive(fine).body["kept"] == []
    for bad in ("3", True, 1.5, [1]):
        rid = ch.send(Kind.EXEC, {"nodes": [], "keep": [], "fetch": [], "after": bad})
        with pytest.raises(DjinnError, match="'after' must be a request id") as err:
            ch.receive(rid)
        assert err.value.code == "INVALID_ARGUMENT"


def test_a_replay_whose_flight_failed_is_not_sent_behind_another_threads_graph(remote):
    """The flight a replay was to go behind (``ahead``) landed and failed, and another
    graph is in flight now (another thread's): the replay is failed unsent with the
    chained error, not sent behind that other graph to run on what the failed one half
    wrote (a review of c1cb15c, whose check was made only where it would not go behind)."""
    from djinn.errors import ExecutionError
    from djinn.runtime.flights import Flight

    s = default_session()
    assert torch.equal(torch.ones(2).to(remote).cpu(), torch.ones(2))
    s._settle()
    failed = Flight(s, {"nodes": [], "keep": []}, [], partial=False)
    failed.landed, failed.error = True, ExecutionError("aten::index: out of bounds")
    other = s.run_graph_async([], [], [], partial=False)  # in flight, fails as a whole
    assert s._flight is other
    f = s.run_graph_async([], [], [], partial=False, ahead=failed)
    assert f.landed and f.rid == 0 and f.behind is None  # never sent
    with pytest.raises(DjinnError, match=r"not run: the graph sent before it failed \(EXEC"):
        f.outcome()
    assert f.chained  # quiet where it lands: the program was told of the first
    assert other.outcome()[0] == []  # the other graph ran, and landed first


@pytest.mark.parametrize("when", ["after both were sent", "before the first was sent"])
def test_a_worker_lost_with_two_replays_sent_recovers_both_in_order(
    own_frontend, monkeypatch, when
):
    """Two replays, the second sent behind the first, and the worker dies. After both were
    sent (it was stopped, then killed): the first's landing rebuilds the session and sends
    it again, and the second, whose connection is gone, is sent again after it. Before the
    first was sent (its send fails): the second goes after the first's recovery, its
    handles renamed for the new worker. The accumulator both write ends as eager's."""
    monkeypatch.setattr(default_session().client, "replay_ahead", "always")
    w = torch.randn(4, 4)
    rw = w.to(R)
    acc = torch.zeros(2, 4)
    racc = acc.to(R)

    def step(t):
        racc.add_((t @ rw).relu())
        return racc.sum()

    f = djinn.replayable(step)
    x = torch.randn(2, 4)
    rx = x.to(R)
    for _ in range(3):
        f(rx)
        acc.add_((x @ w).relu())
    assert torch.equal(racc.cpu(), acc)
    s = default_session()
    pid = next(w["pid"] for w in own_frontend.stats()["workers"] if w["id"] == s.worker)
    os.kill(pid, signal.SIGSTOP if when == "after both were sent" else signal.SIGKILL)
    if when == "before the first was sent":
        wait_for(lambda: any(w["pid"] == pid and not w["alive"]
                             for w in own_frontend.stats()["workers"]))  # fmt: skip
    first, second = f(rx), f(rx)
    if when == "after both were sent":
        assert behind_flags(s) == [True]  # the second went behind the first
        os.kill(pid, signal.SIGKILL)
    for _ in range(2):
        acc.add_((x @ w).relu())
    assert f.stats()["replays"] == 3
    assert torch.equal(second.cpu(), acc.sum())
    assert torch.equal(first.cpu(), (acc - (x @ w).relu()).sum())
    assert torch.equal(racc.cpu(), acc)
    assert s.recovery_stats()["recoveries"] == 1


def behind_flags(s: Session) -> list[bool]:
    """For the graphs of ``s`` in flight, oldest first, whether each went behind another."""
    flights = [f for f, _ in s._older] + ([s._flight] if s._flight is not None else [])
    return [f.behind is not None for f in flights][1:]


def test_what_a_failed_request_freed_is_freed_in_the_journal_too(own_frontend):
    """The worker frees what rides along with a request before it runs it, so a request
    that fails (a graph sent behind a failed one among them) freed it too: the lineage
    journal records it, and a recovery does not rebuild it on the new worker."""
    import gc

    s = default_session()
    r = s.put(torch.ones(4))
    handle = r.handle
    del r
    gc.collect()  # its free rides along with the next request
    with pytest.raises(DjinnError):
        s.execute([{"op": "aten::no_such_op"}])
    freed = [e.body for e in s._lineage.entries if e.kind == "free"]
    assert any(handle in body for body in freed)


def test_a_failed_adam_step_is_raised_once_and_first(remote, behind, ahead, monkeypatch):
    """Call 5's graph with the default Adam's steps fails on the worker (its first inputs
    are made to name a tensor of the wrong shape). Each way the steps are followed, the
    next call or the one after raises that failure, the graph's own error and not "not
    run". (With the split sent first, the next call's split went behind it: a review saw
    the chained error first, and the steps' own raised later by an unrelated read.) Later
    calls raise it from the parameters it poisoned, and unrelated work goes on."""
    from djinn.frontend import inflight
    from djinn.frontend import trace as trace_mod

    junk = torch.zeros(3, 7).to(remote)
    bad = trace_mod.resolved(junk.__dict__["_b"].ref).handle
    corrupt = {"now": False}
    real = inflight.replay_in_flight

    def sending(tr, node, body, inline, form, inputs, **kw):
        if corrupt["now"] and (node.label.startswith("the steps of") or not ahead):
            corrupt["now"] = False
            form = (form[0], [bad] * 3 + list(form[1][3:]), form[2])
        return real(tr, node, body, inline, form, inputs, **kw)

    monkeypatch.setattr(inflight, "replay_in_flight", sending)
    model = _mlp().to(remote)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(4)
    step = djinn.replayable(_step_of(model, opt))
    raised: list[str | None] = []
    for i in range(9):
        x, y = torch.randn(5, 8, generator=gen), torch.randn(5, 4, generator=gen)
        corrupt["now"] = i == 5
        try:
            step(x.to(remote), y.to(remote))
            raised.append(None)
        except DjinnError as exc:
            raised.append(str(exc))
    first = next(i for i, why in enumerate(raised) if why)
    assert first in (6, 7), raised  # a call later, or two when sent ahead whole
    assert all(raised[first:]), raised
    assert not any("not run" in why for why in raised[first:]), raised
    with pytest.raises(DjinnError) as read:
        next(model.parameters()).detach().cpu()
    assert "not run" not in str(read.value)
    assert torch.equal((torch.ones(2).to(remote) * 3).cpu(), torch.full((2,), 3.0))


def test_a_graph_landed_failed_by_another_thread_while_steps_are_followed_stops_the_next(
    remote, behind, monkeypatch
):
    """The whole recording goes after its steps are followed (Note [followed steps]),
    behind the last call's graph. If another thread lands that graph meanwhile and it
    failed, there is nothing left in flight for the worker to check ``after`` against:
    the next graph must not run on what the failed one half wrote. It holds the failure
    ("not run") instead, as it would have from BEHIND_FAILED; before the check at send
    time (a review named the window) its loss came back as a number."""
    import threading

    from djinn.frontend import inflight, replay_follow, replay_followed
    from djinn.frontend import trace as trace_mod

    monkeypatch.setattr(replay_followed, "overlapped", lambda session: False)
    junk = torch.zeros(3, 7).to(remote)
    bad = trace_mod.resolved(junk.__dict__["_b"].ref).handle
    state = {"corrupt": False, "land_first": False}
    real_send, real_finish = inflight.replay_in_flight, replay_follow.Follower.finish

    def sending(tr, node, body, inline, form, inputs, **kw):
        if state["corrupt"]:
            state["corrupt"] = False
            form = (form[0], [bad] * 3 + list(form[1][3:]), form[2])
        return real_send(tr, node, body, inline, form, inputs, **kw)

    def finishing(self):
        if state["land_first"]:  # another thread lands the last call's graph, now
            state["land_first"] = False
            other = threading.Thread(target=inflight.land_all)
            other.start()
            other.join()
        return real_finish(self)

    monkeypatch.setattr(inflight, "replay_in_flight", sending)
    monkeypatch.setattr(replay_follow.Follower, "finish", finishing)
    model = _mlp().to(remote)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(5)
    step = djinn.replayable(_step_of(model, opt))
    losses = []
    for i in range(6):
        x, y = torch.randn(5, 8, generator=gen), torch.randn(5, 4, generator=gen)
        state["corrupt"], state["land_first"] = i == 4, i == 5
        losses.append(step(x.to(remote), y.to(remote)))
        if i < 4:
            losses[-1].cpu()  # the loop before the failure ran
    assert step.stats()["steps_followed"] == 3, step.stats()  # calls 3 to 5
    with pytest.raises(DjinnError, match="not run: the graph sent before it failed"):
        losses[5].cpu()
    with pytest.raises(DjinnError) as read:
        next(model.parameters()).detach().cpu()
    assert "not run" not in str(read.value)  # the failed graph's own error
