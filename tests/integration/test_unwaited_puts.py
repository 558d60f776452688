"""Note [puts sent without waiting] (djinn/runtime/puts.py): a put the client does not
wait for names its handles itself, returns at once, and its reply is read by the
session's next request. Its values, its failures and its recovery are those of a waited
put."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from djinn.errors import InvalidArgument, QuotaExceeded
from djinn.protocol.frames import Kind
from djinn.protocol.tensors import to_wire
from tests.conftest import wait_for

MIB = 1 << 20
R = "remote_accelerator:0"


@pytest.mark.parametrize("via", ["unix", "tcp"])
def test_puts_not_waited_for_hold_their_values(appliance, via):
    """Sizes inline and through the arena (unix), back to back and read in any order; the
    source changed after its put returned does not change what was put."""
    sizes = [4, 1000, 70_000, 300_000, 4, 300_000]
    with appliance.connect(via) as client, client.session() as s:
        sources = [torch.arange(n, dtype=torch.float32) * (i + 1) for i, n in enumerate(sizes)]
        remotes = [s.put(t, wait=False) for t in sources]
        assert s._puts, "a put not waited for was waited for"
        want = [t.clone() for t in sources]
        for t in sources:
            t.fill_(-1.0)  # eager semantics: the put copied the bytes before it returned
        for i in (3, 0, 5, 1, 4, 2):
            assert torch.equal(remotes[i].cpu(), want[i])
        assert not s._puts  # the first read read every reply
        # a waited put and a graph behind them see the same handles
        _, (total,) = s.execute(
            [{"op": "aten::sum.default", "args": [remotes[2].ref()]}], fetch=[{"$v": 0}]
        )
        assert total.item() == pytest.approx(want[2].sum().item())


def test_unread_puts_are_bounded_by_what_the_connection_can_hold(appliance):
    """Puts of 32 KiB sent inline without waiting: once both their frames and their
    replies could fill the connection's buffers, the next put reads the replies first
    (the worker stops reading a session whose reply it cannot write: both ends would
    wait on each other)."""
    with appliance.connect("tcp") as client, client.session() as s:
        most = 0
        remotes = []
        for i in range(150):
            remotes.append(s.put(torch.full((8192,), float(i)), wait=False))
            most = max(most, len(s._puts))
        assert 1 < most <= 65
        for i, r in enumerate(remotes):
            assert torch.equal(r.cpu(), torch.full((8192,), float(i)))


def test_a_put_not_waited_for_that_fails_fails_its_tensor_with_the_puts_error(fresh_appliance):
    """Over the session's device quota: the put returns, and its tensor raises the
    QUOTA_EXCEEDED the appliance answered, wherever it is used; nothing else is lost."""
    app = fresh_appliance(session_device_max="2MiB", inline_max_bytes="4MiB")
    with app.connect("tcp") as client, client.session() as s:
        kept = s.put(torch.ones(MIB // 4))  # 1 MiB: within the quota
        over = s.put(torch.ones(MIB // 2), wait=False)  # 2 MiB more: over it
        # a graph sent before the failure was read: the appliance says why, by its type
        with pytest.raises(QuotaExceeded, match=r"its PUT failed.*session_device_max"):
            s.execute([{"op": "aten::sum.default", "args": [over.ref()]}], fetch=[{"$v": 0}])
        assert isinstance(over.failed, QuotaExceeded)
        with pytest.raises(QuotaExceeded, match=r"its PUT failed.*session_device_max"):
            over.cpu()
        assert torch.equal(kept.cpu(), torch.ones(MIB // 4))
        # a GET sent behind it, before its reply was read (Session._get_behind_puts)
        again = s.put(torch.ones(MIB // 2), wait=False)
        assert s._puts
        with pytest.raises(QuotaExceeded, match=r"its PUT failed.*session_device_max") as first:
            again.cpu()
        assert isinstance(again.failed, QuotaExceeded) and not s._puts
        # read again, the tensor raises what the first read raised (it raised the
        # appliance's words and then its own)
        with pytest.raises(QuotaExceeded) as second:
            again.cpu()
        assert str(second.value) == str(first.value)
        small = s.put(torch.ones(4), wait=False)
        assert torch.equal(small.cpu(), torch.ones(4))
        assert s.memory_allocated() == MIB + 16  # the failed put holds nothing
        del over  # its handle was never the appliance's: nothing is freed for it
        assert s.memory_allocated() == MIB + 16


def test_x_to_remote_over_the_quota_raises_the_quota_error_where_it_is_read(fresh_appliance):
    """The frontend's `.to(remote)` is a put not waited for: the error comes where the
    program reads what depends on it, typed as the appliance answered it."""
    from tests.conftest import frontend_at

    app = fresh_appliance(session_device_max="1MiB")
    with frontend_at(app.unix):
        x = torch.ones(MIB // 2).to(R)  # 2 MiB: over the quota
        with pytest.raises(QuotaExceeded, match="session_device_max"):
            (x * 2).cpu()
        y = torch.arange(4.0).to(R)
        assert torch.equal((y * 2).cpu(), torch.arange(4.0) * 2)  # the session goes on


def _raw_put(s, names: list, values: list[torch.Tensor]) -> dict:
    entries, segments = [], []
    for name, t in zip(names, values, strict=True):
        desc, flat = to_wire(t)
        entries.append({"desc": desc, "seg": len(segments), "name": name})
        segments.append(memoryview(flat.numpy()))
    return s._call(Kind.PUT, {"tensors": entries}, segments).body


@pytest.mark.parametrize(
    "name",
    ["short", "x" * 65, "has space in it..", "a/b" * 8, 12345678901234567, None],
    ids=["short", "long", "space", "slash", "int", "one-unnamed"],
)
def test_a_put_naming_a_malformed_handle_is_refused_and_keeps_nothing(appliance, name):
    with appliance.connect() as client, client.session() as s:
        before = s.memory_allocated()
        with pytest.raises(InvalidArgument, match="PUT name"):
            _raw_put(s, ["a" * 22, name], [torch.ones(4), torch.ones(4)])
        assert s.memory_allocated() == before


def test_a_put_naming_a_handle_in_use_is_refused_and_the_tensor_kept(appliance):
    with appliance.connect() as client, client.session() as s:
        name = "N" * 22
        assert _raw_put(s, [name], [torch.ones(4)])["handles"] == [name]
        with pytest.raises(InvalidArgument, match="already in use"):
            _raw_put(s, [name], [torch.zeros(4)])
        with pytest.raises(InvalidArgument, match="already in use"):
            _raw_put(s, ["M" * 22, "M" * 22], [torch.zeros(4), torch.zeros(4)])
        got = s._unpack(s._call(Kind.GET, {"handles": [name]}))["tensors"][0]
        assert torch.equal(got, torch.ones(4))  # the first put's, untouched


def test_the_same_name_in_two_sessions_names_two_tensors(appliance):
    """Names live in each session's own table: choosing another session's name reaches
    nothing of it."""
    name = "shared-name-000000000"
    with appliance.connect() as client, client.session() as a, client.session() as b:
        _raw_put(a, [name], [torch.ones(4)])
        _raw_put(b, [name], [torch.zeros(4)])
        for s, want in ((a, torch.ones(4)), (b, torch.zeros(4))):
            got = s._unpack(s._call(Kind.GET, {"handles": [name]}))["tensors"][0]
            assert torch.equal(got, want)


def test_a_put_not_waited_for_whose_worker_dies_is_put_again_by_the_recovery(fresh_appliance):
    """The worker is killed before the put's reply is read: the recovering session is
    rebuilt on the next request, and the journal (which recorded the put as it was sent)
    puts it again."""
    app = fresh_appliance(cpu_workers=1, restart_backoff_max=1.0)
    with app.connect() as client, client.session(recover=True) as s:
        small, big = torch.arange(8.0), torch.arange(100_000.0)
        rs, rb = s.put(small, wait=False), s.put(big, wait=False)
        pid = next(w["pid"] for w in app.stats()["workers"] if w["id"] == s.worker)
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: all(w["pid"] != pid or not w["alive"] for w in app.stats()["workers"]))
        assert torch.equal(rb.cpu(), big)
        assert torch.equal(rs.cpu(), small)
        assert s.recovery_stats()["recoveries"] == 1


def test_a_put_behind_a_graph_parked_for_memory_is_answered_after_it(fresh_appliance):
    """The graph waits in the admission queue for memory another session holds; the put
    sent behind it is not read (and answered first) meanwhile: replies stay in order."""
    import threading

    app = fresh_appliance(cpu_worker_memory="48MiB", admission_timeout=30.0)
    with app.connect() as client, client.session() as s, client.session() as hog:
        blob = hog.put(torch.ones(6 * MIB))  # 24 MiB of the 48
        big = {"op": "aten::zeros.default", "args": [[8 * MIB]]}  # 32 MiB more: parked
        nodes = [big, {"op": "aten::sum.default", "args": [{"$v": 0}]}]
        f = s.run_graph_async(nodes, keep=[{"$v": 1}], inline=[], partial=False)
        wait_for(lambda: app.stats()["memory"][0]["admission"]["waiting"] == 1)
        r = s.put(torch.arange(4.0), wait=False)
        threading.Timer(0.5, blob.free).start()  # lets the graph in
        (total,), _, failure = f.outcome()
        assert failure is None and total.cpu().item() == 0.0
        assert torch.equal(r.cpu(), torch.arange(4.0))


def test_many_tensors_put_in_one_request_without_waiting_do_not_stall(appliance):
    """A put of 4096 tensors answers 4096 names: its reply's size counts towards what may
    be left unread (a review saw the sixth such put wait 30 s, then the session end)."""
    with appliance.connect() as client, client.session() as s:
        tensors = [torch.tensor([float(i)]) for i in range(4096)]
        for _ in range(8):
            remotes = s.put_many(tensors, wait=False)
        assert len(s._puts) <= 2
        assert remotes[4095].cpu().item() == 4095.0


def test_a_put_that_failed_unread_when_its_worker_died_fails_again_alone(fresh_appliance):
    """A recovering session's journal recorded the put as it was sent; the rebuild puts it
    again in the journal's order, it fails again (over the quota), and that is the put's
    own error, not the recovery's: the tensors put before it are rebuilt."""
    app = fresh_appliance(cpu_workers=1, restart_backoff_max=1.0, session_device_max="2MiB")
    with app.connect() as client, client.session(recover=True) as s:
        kept = s.put(torch.ones(MIB // 4))  # 1 MiB
        over = s.put(torch.ones(MIB // 2), wait=False)  # 2 MiB more: over, not read yet
        pid = next(w["pid"] for w in app.stats()["workers"] if w["id"] == s.worker)
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: all(w["pid"] != pid or not w["alive"] for w in app.stats()["workers"]))
        assert torch.equal(kept.cpu(), torch.ones(MIB // 4))
        assert s.recovery_stats()["recoveries"] == 1
        with pytest.raises(QuotaExceeded, match="session_device_max"):
            over.cpu()


def test_an_operator_ending_a_session_answers_the_requests_read_behind_a_parked_one(
    fresh_appliance,
):
    """The worker is stopped while the client sends a graph and a put behind it, so both
    arrive in one read; the graph parks for memory, and an operator ends the session.
    Both get SESSION_ENDED (the put used to wait for ever: no new bytes woke the worker
    to answer what it had read already)."""
    import djinn
    from djinn.errors import SessionEnded

    app = fresh_appliance(cpu_worker_memory="48MiB", admission_timeout=60.0, memory_policy="off")
    with app.connect() as client, client.session() as s, client.session() as hog:
        blob = hog.put(torch.ones(6 * MIB))  # 24 MiB of the 48
        s.put(torch.zeros(4)).cpu()
        pid = next(w["pid"] for w in app.stats()["workers"] if w["id"] == s.worker)
        os.kill(pid, signal.SIGSTOP)
        try:
            big = {"op": "aten::zeros.default", "args": [[8 * MIB]]}
            nodes = [big, {"op": "aten::sum.default", "args": [{"$v": 0}]}]
            f = s.run_graph_async(nodes, keep=[{"$v": 1}], inline=[], partial=False)
            r = s.put(torch.arange(4.0), wait=False)
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_for(lambda: app.stats()["memory"][0]["admission"]["waiting"] == 1)
        with djinn.connect(app.unix) as operator:
            assert operator.kill_session(s.id)
        with pytest.raises(SessionEnded):
            f.outcome()
        with pytest.raises(SessionEnded):
            r.cpu()
        assert blob.cpu().shape == (6 * MIB,)


def test_a_tensor_a_recovery_could_not_rebuild_raises_without_more_recoveries(
    fresh_appliance,
):
    """`get` checks a tensor's failure again after a recovery, but the SESSION_LOST a
    rebuild leaves on a tensor it could not rebuild is no new fault: it is raised, and
    the session is not rebuilt again (a review saw three rebuilds, then RECOVERY_FAILED)."""
    from djinn.errors import SessionLost

    app = fresh_appliance()
    with app.connect() as client, client.session(recover=True) as s:
        x, y = s.put(torch.arange(4.0)), s.put(torch.ones(3))
        x.failed = SessionLost("this tensor's value was not rebuilt (as Lineage._rebind says)")
        with pytest.raises(SessionLost, match="not rebuilt"):
            x.cpu()
        assert s.recovery_stats()["recoveries"] == 0 and s.usable
        assert torch.equal(y.cpu(), torch.ones(3))
