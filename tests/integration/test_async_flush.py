"""Note [asynchronous flushes] (djinn/frontend/inflight.py): a graph one thread reads from
another's capture is sent without waiting, the session's next request reads its reply
first, and its failures land where a synchronous flush would have put them."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from djinn.errors import DjinnError
from djinn.frontend.session import default_session
from djinn.runtime.channel import Channel
from djinn.runtime.session import Session
from tests.conftest import wait_for

R = "remote_accelerator:0"


@pytest.fixture
def frontend(own_frontend):
    """The transparent frontend on an appliance of its own."""
    return own_frontend


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def _train(model, device: str, steps: int = 4) -> list[torch.Tensor]:
    model = model.to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 2, generator=gen)
        loss = torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach().cpu() for p in model.parameters()]


def test_backward_sends_its_graphs_without_waiting_and_matches_eager(frontend, monkeypatch):
    sent = []
    real = Session.run_graph_async

    def counting(self, nodes, keep, inline):
        sent.append(len(nodes))
        return real(self, nodes, keep, inline)

    monkeypatch.setattr(Session, "run_graph_async", counting)
    want = _train(_model(), "cpu")
    got = _train(_model(), R)
    # per step: the forward (sent by backward's thread) and the backward (at its end)
    assert len(sent) >= 2 * 4 - 1
    for a, b in zip(got, want, strict=True):
        assert (a - b).abs().max().item() <= 1e-5


def test_a_request_made_while_a_graph_is_in_flight_reads_its_reply_first(frontend):
    s = default_session()
    a = s.put(torch.arange(6.0))
    nodes = [{"op": "aten::mul.Tensor", "args": [{"$h": a.handle}, 3.0]}]
    flight = s.run_graph_async(nodes, [{"$v": 0}], [])
    b = s.put(torch.ones(2))  # a request of its own while the graph's reply is unread
    assert torch.equal(b.cpu(), torch.ones(2))
    kept, fetched, failure = flight.outcome()
    assert failure is None and fetched == []
    assert torch.equal(kept[0].cpu(), torch.arange(6.0) * 3)


def test_a_graph_that_fails_in_flight_fails_what_depends_on_it(frontend):
    """The forward graph, sent by backward's thread, fails on the appliance (an index out
    of range is only seen by the real kernel): the gradients hold the typed error, and
    the session goes on."""
    w = torch.nn.Parameter(torch.randn(4, 3))
    remote_w = torch.nn.Parameter(w.detach().to(R))
    bad = torch.tensor([0, 7])  # row 7 of 4
    with pytest.raises(DjinnError):
        loss = remote_w.index_select(0, bad.to(R)).sum()
        loss.backward()
        remote_w.grad.cpu()
    ok = torch.nn.Parameter(torch.randn(4, 3))
    remote_ok = torch.nn.Parameter(ok.detach().to(R))
    (remote_ok * 2).sum().backward()
    assert torch.equal(remote_ok.grad.cpu(), torch.full((4, 3), 2.0))


def test_a_worker_lost_with_a_graph_in_flight_is_recovered(frontend):
    """The worker dies before the graph's reply is read: the recovering session is
    rebuilt and the graph sent again, with the same result."""
    s = default_session()
    a = s.put(torch.arange(4.0))
    pid = next(w["pid"] for w in frontend.stats()["workers"] if w["id"] == s.worker)
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: all(w["pid"] != pid or not w["alive"] for w in frontend.stats()["workers"]))
    nodes = [{"op": "aten::add.Tensor", "args": [{"$h": a.handle}, 1.0]}]
    flight = s.run_graph_async(nodes, [{"$v": 0}], [])
    kept, _, failure = flight.outcome()
    assert failure is None
    assert torch.equal(kept[0].cpu(), torch.arange(4.0) + 1)
    assert s.recovery_stats()["recoveries"] == 1


def test_a_graph_sent_without_waiting_says_so_whole_and_as_a_template(frontend, monkeypatch):
    """Note [a capturing client beside its worker]: the worker gives a graph marked
    "unwaited" one thread fewer. The mark is part of the graph as sent (whole or by
    template), never of timing, so a replay of it gets the same thread count."""
    sent: list[dict] = []
    real = Session._exec_form

    def spy(self, body, known=None):
        form = real(self, body, known)
        sent.append(form[0])
        return form

    monkeypatch.setattr(Session, "_exec_form", spy)
    _train(_model(), R, steps=6)
    unwaited = [b for b in sent if b.get("unwaited") is True]
    waited = [b for b in sent if "unwaited" not in b]
    assert any("graph" in b for b in unwaited)  # a repeated step, by its template
    assert any("nodes" in b for b in unwaited)  # its first time, whole
    assert all(b.get("fetch") == [] for b in unwaited if "nodes" in b)
    assert waited  # reading the parameters back waits


@pytest.mark.parametrize("sent", ["waited", "unwaited"])
def test_with_a_thread_left_to_the_client_a_replay_gives_the_first_runs_bits(fresh_appliance, sent):
    """Note [a capturing client beside its worker], ``cpu_threads_beside_client = true``:
    a graph runs with one thread fewer when it was sent unwaited and with all of them when
    its client waited, and a replay after a lost worker runs it as it was sent: the same
    bits (a sum of 4M floats rounds otherwise on one thread than on two)."""
    from djinn.frontend.session import default_session
    from tests.conftest import frontend_at

    app = fresh_appliance(cpu_workers=1, restart_backoff_max=1.0, cpu_threads_beside_client=True)
    x = torch.randn(4, 1 << 20, generator=torch.Generator().manual_seed(0))
    with frontend_at(app.unix):
        s = default_session()
        if sent == "waited":
            total = x.to(R).sum()
            first = total.cpu()  # a graph that fetches: its client waits for it
        else:
            a = s.put(x)
            nodes = [{"op": "aten::sum.default", "args": [{"$h": a.handle}]}]
            kept, _, failure = s.run_graph_async(nodes, [{"$v": 0}], []).outcome()
            assert failure is None
            total = kept[0]
            first = total.cpu()
        pid = next(w["pid"] for w in app.stats()["workers"] if w["id"] == s.worker)
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: all(w["pid"] != pid or not w["alive"] for w in app.stats()["workers"]))
        again = total.cpu()  # the worker is gone: the session is rebuilt by replaying
        assert s.recovery_stats()["recoveries"] == 1
    assert torch.equal(again, first)


def test_a_session_whose_last_graph_was_not_read_yet_outlives_a_pause(fresh_appliance):
    """Note [a beat after a flight] (djinn/runtime/session.py): the heartbeat thread skipped
    its beats while a graph sent without waiting had not been read; once the worker had
    answered it, the lease ran out in a pause of the program (SESSION_EXPIRED at its next
    request). The heartbeat thread now reads the answer and beats on."""
    import time

    from djinn.frontend.session import default_session
    from tests.conftest import frontend_at

    app = fresh_appliance(heartbeat_interval=0.5, heartbeat_misses=2)  # a 1 s lease
    with frontend_at(app.unix):
        s = default_session()
        a = s.put(torch.arange(4.0))
        nodes = [{"op": "aten::add.Tensor", "args": [{"$h": a.handle}, 1.0]}]
        flight = s.run_graph_async(nodes, [{"$v": 0}], [])
        time.sleep(3.0)  # three leases: the program does something else
        kept, _, failure = flight.outcome()
        assert failure is None
        assert torch.equal(kept[0].cpu(), torch.arange(4.0) + 1)


def test_graphs_sent_without_waiting_give_the_journal_their_template(frontend, monkeypatch):
    """Note [journal facts of a template]: a captured graph's template, worked out for the
    wire, also spares the journal its walk of every node; it was used by replays only."""
    from djinn.frontend.session import default_session
    from djinn.runtime import lineage

    walks = []
    real = lineage.mark_views
    monkeypatch.setattr(lineage, "mark_views", lambda *a: walks.append(1) or real(*a))
    want = _train(_model(), "cpu", steps=6)
    got = _train(_model(), R, steps=6)
    for a, b in zip(got, want, strict=True):
        assert (a - b).abs().max().item() <= 1e-5
    journal = default_session()._lineage
    assert journal is not None and journal._facts, len(walks)  # the steps' templates
    assert len(walks) <= 6, len(walks)  # the graphs too small to go by template walk as before


def test_a_graph_another_thread_is_settling_is_waited_for(frontend, monkeypatch):
    """Thread Y took the graph from the session's slot and is reading its reply when the
    program asks for its outcome: it waits for Y's reading (it found the slot empty and
    took the graph for settled: an AssertionError seen by a review's replaying threads)."""
    s = default_session()
    a = s.put(torch.arange(6.0))
    reading, release = threading.Event(), threading.Event()
    real = Channel.receive

    def slow(self, rid):
        reading.set()
        release.wait(10)
        return real(self, rid)

    monkeypatch.setattr(Channel, "receive", slow)
    nodes = [{"op": "aten::mul.Tensor", "args": [{"$h": a.handle}, 3.0]}]
    flight = s.run_graph_async(nodes, [{"$v": 0}], [])
    y = threading.Thread(target=s._settle)
    y.start()
    assert reading.wait(10)
    got, errors = [], []

    def outcome():
        try:
            got.append(flight.outcome())
        except BaseException as exc:
            errors.append(exc)

    x = threading.Thread(target=outcome)
    x.start()
    time.sleep(0.2)  # X asks while Y reads (if X is late, the test is only weaker)
    release.set()
    y.join(10)
    x.join(10)
    monkeypatch.undo()
    assert errors == [] and len(got) == 1
    kept, _fetched, failure = got[0]
    assert failure is None and torch.equal(kept[0].cpu(), torch.arange(6.0) * 3)


def test_a_graph_read_late_costs_the_journal_what_it_ran(frontend):
    """Note [a flight's cost]: a graph whose reply the program reads late is recorded with
    the time the worker says it ran, not the time until it was read (a replay is read a
    whole loop iteration later: a journal that counted that cut itself far too often)."""
    s = default_session()
    a = s.put(torch.arange(6.0))
    nodes = [{"op": "aten::mul.Tensor", "args": [{"$h": a.handle}, 3.0]}]
    s.execute(nodes, keep=[{"$v": 0}])  # warm: a worker's first op takes most of a second
    flight = s.run_graph_async(nodes, [{"$v": 0}], [])
    time.sleep(0.3)  # the program's own work before it reads the reply
    kept, _fetched, failure = flight.outcome()
    assert failure is None and torch.equal(kept[0].cpu(), torch.arange(6.0) * 3)
    entry = next(e for e in reversed(s._lineage.entries) if e.kind == "exec")
    assert 0 <= entry.seconds < 0.3, entry.seconds


@pytest.mark.parametrize(
    ("op", "then"),
    [
        (torch.ops.aten.add.Tensor, lambda a: a + 1),
        # a data-dependent op joins the trace and flushes it at once (immediate._run_now)
        (torch.ops.aten.nonzero.default, torch.nonzero),
    ],
    ids=["captured", "run now"],
)
def test_an_op_whose_trace_another_thread_flushes_as_it_is_captured_keeps_its_output(
    frontend, monkeypatch, op, then
):
    """A thread that reads a tensor another thread's trace holds sends that trace (Note
    [asynchronous flushes]). It must not send it between an op's node joining the trace and
    the op's output being bound to its tensor: the graph would run the node with nothing
    holding its output, which then reads as released. The capturing thread stops in that
    window here (for up to 1 s) while the other thread reads."""
    from djinn.frontend import trace as trace_mod

    base = torch.arange(6.0).to(R)
    added, read = threading.Event(), threading.Event()
    add = trace_mod.Trace.add

    def pausing(self, node):
        add(self, node)
        if node.op is op and threading.current_thread() is capturer:
            added.set()
            read.wait(1.0)  # the read below runs now, or once this op is bound

    monkeypatch.setattr(trace_mod.Trace, "add", pausing)
    got: dict[str, torch.Tensor] = {}

    def capture() -> None:
        got["a"] = a = base * 2  # pending in the capturing thread's trace
        got["b"] = then(a)

    def reader() -> None:
        added.wait(5.0)
        got["read"] = (got["a"] * 3).cpu()  # sends the capturing thread's trace
        read.set()

    capturer = threading.Thread(target=capture)
    other = threading.Thread(target=reader)
    other.start()
    capturer.start()
    capturer.join(10.0)
    other.join(10.0)
    assert torch.equal(got["read"], torch.arange(6.0) * 6)
    assert torch.equal(got["b"].cpu(), then(torch.arange(6.0) * 2))
