"""The worker's scheduler and the built-in policies (issue 10), on a fake clock.

Each mechanism runs under every built-in policy (DESIGN.md §10): per-session order, slices,
preemption and cancellation are the scheduler's and must hold whatever the policy picks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from djinn.appliance.scheduler import Scheduler, parse_weights, tenant_of, work_facts
from djinn.plugins.schedulers import FifoScheduler, SemanticScheduler
from djinn.protocol.frames import Kind
from djinn.semantics.scheduling import SchedulerPolicy, SchedulingView, WorkFacts

POLICIES = [SemanticScheduler(), FifoScheduler()]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class FakeSession:
    id: str
    peer: str = "unix:pid=1,uid=1000"
    phase: str = "unknown"
    handles: dict = field(default_factory=dict)


def frame(kind: Kind, **body):
    return SimpleNamespace(kind=kind, body=body)


def graph(clock: Clock, log: list, name: str, ops: int, op_s: float = 0.001):
    """A request that takes ``ops`` steps of ``op_s`` each, logging each step."""

    def steps():
        for i in range(ops):
            if i:
                yield  # between steps, as GraphRun.steps does
            clock.now += op_s
            log.append((name, i))

    return steps()


def run_all(sched: Scheduler, gens: dict, done: list, limit: int = 10_000) -> None:
    for _ in range(limit):
        if not sched:
            return
        sched.run_slice(lambda w: gens[w.session.id], lambda w: done.append(w.session.id))
    if limit > 1:
        raise AssertionError("work never finished")


def submit(sched: Scheduler, s: FakeSession, kind: Kind, **body) -> None:
    f = frame(kind, **body)
    sched.submit(s, f, work_facts(s, f))


def test_policies_satisfy_the_contract():
    for policy in POLICIES:
        assert isinstance(policy, SchedulerPolicy)


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
def test_every_request_finishes_and_a_session_has_one_at_a_time(policy):
    clock, log, done = Clock(), [], []
    sched = Scheduler(policy, slice_s=0.003, clock=clock)
    sessions = [FakeSession(f"s{i}") for i in range(4)]
    gens = {s.id: graph(clock, log, s.id, ops=10 * (i + 1)) for i, s in enumerate(sessions)}
    for s in sessions:
        submit(sched, s, Kind.EXEC, nodes=[{}] * 10)
    with pytest.raises(RuntimeError):
        submit(sched, sessions[0], Kind.EXEC, nodes=[])
    run_all(sched, gens, done)
    assert sorted(done) == sorted(s.id for s in sessions)
    for s in sessions:  # each graph's steps ran in order, none twice
        mine = [i for name, i in log if name == s.id]
        assert mine == list(range(len(mine)))


def test_semantic_preempts_a_long_graph_for_a_decode_step_fifo_does_not():
    for policy, first in ((SemanticScheduler(), "decode"), (FifoScheduler(), "train")):
        clock, log, done = Clock(), [], []
        sched = Scheduler(policy, slice_s=0.005, clock=clock)
        train, chat = FakeSession("train"), FakeSession("decode")
        gens = {
            "train": graph(clock, log, "train", ops=500),
            "decode": graph(clock, log, "decode", 3),
        }
        submit(sched, train, Kind.EXEC, nodes=[{}] * 500)
        run_all(sched, gens, done, limit=1)
        submit(sched, chat, Kind.CALL, method="forward", hints={"phase": "decode"})
        run_all(sched, gens, done)
        assert done[0] == first, policy.name
        assert (sched.preemptions > 0) == (policy.name == "semantic")


def test_weighted_fair_shares_between_tenants():
    clock, log, done = Clock(), [], []
    weights = parse_weights("uid:1=2, uid:2=1")
    sched = Scheduler(SemanticScheduler(), slice_s=0.01, clock=clock, weights=weights)
    a, b = FakeSession("a", "unix:pid=5,uid=1"), FakeSession("b", "unix:pid=6,uid=2")
    gens = {s.id: graph(clock, log, s.id, ops=5000) for s in (a, b)}
    for s in (a, b):
        submit(sched, s, Kind.EXEC, nodes=[{}] * 5000)
    for _ in range(300):  # 3 s of device time, well inside both graphs
        sched.run_slice(lambda w: gens[w.session.id], lambda w: done.append(w.session.id))
    ran_a = sum(1 for name, _ in log if name == "a")
    ran_b = sum(1 for name, _ in log if name == "b")
    assert ran_a / (ran_a + ran_b) == pytest.approx(2 / 3, abs=0.05)
    tenants = sched.stats()["tenants"]  # the undecayed account an operator compares
    assert tenants["uid:1"]["weight"] == 2 and tenants["uid:2"]["weight"] == 1
    assert tenants["uid:1"]["exec_s"] / tenants["uid:2"]["exec_s"] == pytest.approx(2, rel=0.1)


def test_ageing_lets_throughput_work_through_a_stream_of_interactive_work():
    clock, log, done = Clock(), [], []
    sched = Scheduler(SemanticScheduler(), slice_s=0.005, max_wait_s=0.2, clock=clock)
    big = FakeSession("big")
    gens = {"big": graph(clock, log, "big", ops=5)}
    submit(sched, big, Kind.EXEC, nodes=[{}] * 500)
    k = 0
    while "big" not in done:
        k += 1
        assert k < 1000, "the big graph starved"
        s = FakeSession(f"chat{k}", peer=f"unix:pid={k},uid={k}")  # fresh tenants: no usage
        gens[s.id] = graph(clock, log, s.id, ops=2, op_s=0.004)
        submit(sched, s, Kind.CALL, method="forward", hints={"phase": "decode"})
        sched.run_slice(lambda w: gens[w.session.id], lambda w: done.append(w.session.id))
    assert clock.now < 1.0


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
def test_cancelling_a_session_closes_its_half_run_graph(policy):
    clock, log, done = Clock(), [], []
    closed = []

    def steps():
        try:
            for i in range(100):
                clock.now += 0.001
                log.append(i)
                yield
        finally:
            closed.append(True)

    sched = Scheduler(policy, slice_s=0.005, clock=clock)
    s = FakeSession("s")
    submit(sched, s, Kind.EXEC, nodes=[{}] * 100)
    sched.run_slice(lambda w: steps(), lambda w: done.append(w))
    assert sched.has(s) and 0 < len(log) < 100
    sched.cancel(s)
    assert closed == [True] and not sched and not sched.has(s) and done == []


def test_a_failing_policy_falls_back_to_arrival_order():
    class Broken:
        name = "broken"

        def choose(self, view: SchedulingView) -> int:
            raise ValueError("bug")

    clock, log, done = Clock(), [], []
    sched = Scheduler(Broken(), clock=clock)
    sessions = [FakeSession("x"), FakeSession("y")]
    gens = {s.id: graph(clock, log, s.id, 2) for s in sessions}
    for s in sessions:
        clock.now += 0.001
        submit(sched, s, Kind.EXEC, nodes=[])
    run_all(sched, gens, done)
    assert done == ["x", "y"]


def test_what_policies_see_of_a_request():
    s = FakeSession("s", peer="tcp:10.0.0.7:5555", phase="prefill")
    facts = work_facts(
        s, frame(Kind.CALL, method="forward", args=[{"$t": 0, "desc": {"shape": [2, 3]}}])
    )
    assert facts == {
        "kind": "CALL",
        "phase": "prefill",
        "method": "forward",
        "tokens": 6,
        "batch": "",  # six positions: not a decode step
    }
    assert work_facts(s, frame(Kind.EXEC, nodes=[{}, {}]))["nodes"] == 2
    assert tenant_of(s.peer) == "host:10.0.0.7"
    assert tenant_of("unix:pid=3,uid=1000") == "uid:1000"


def test_semantic_classes():
    sem = SemanticScheduler()
    view = SchedulingView(items=(), running=None, small_graph_nodes=64, max_wait_s=0.5)

    def cls(**kw) -> int:
        return sem._class(WorkFacts(key=0, session="s", tenant="t", **kw), view)

    assert cls(kind="EXEC", nodes=10) == 0 and cls(kind="EXEC", nodes=1000) == 1
    assert cls(kind="CALL", phase="decode") == 0 and cls(kind="CALL", tokens=1) == 0
    assert cls(kind="CALL", tokens=512) == 1 and cls(kind="CALL", method="generate") == 1
    assert cls(kind="PUT") == 0 and cls(kind="REGISTER") == 1
    assert cls(kind="EXEC", nodes=1000, waited_s=0.6) == 0  # aged


# -- cross-session batching (Note [cross-session batching]) ------------------------------
def _decode_step(fp: str = "f" * 32, **kwargs):
    body = {
        "fingerprint": fp,
        "args": [{"$t": 0, "desc": {"shape": [1, 1], "dtype": "int64"}}],
        "kwargs": {"use_cache": True, "past_key_values": {"$o": "c1"}, **kwargs},
    }
    return frame(Kind.CALL, **body)


def test_only_plain_single_token_steps_on_a_cache_are_batchable():
    s = FakeSession("a")
    assert work_facts(s, _decode_step())["batch"] == "model:" + "f" * 32
    assert work_facts(s, _decode_step(output_attentions=True))["batch"] == ""
    prefill = _decode_step()
    prefill.body["args"][0]["desc"]["shape"] = [1, 7]  # seven positions: a prefill
    assert work_facts(s, prefill)["batch"] == ""
    no_cache = _decode_step()
    del no_cache.body["kwargs"]["past_key_values"]
    assert work_facts(s, no_cache)["batch"] == ""
    generate = _decode_step()
    generate.body["method"] = "generate"
    assert work_facts(s, generate)["batch"] == ""


class Batches:
    """The worker's side, faked: a batch marks its members batched; each request, when it
    runs, logs whether its step was computed in a batch (and with whom)."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.batches: list[list[str]] = []
        self.ran: list[str] = []

    def batch(self, works) -> None:
        if len(works) > 1:
            self.batches.append([w.session.id for w in works])
            for w in works:
                w.batched = True

    def start(self, work):
        self.ran.append(work.session.id)
        return iter(())

    def slice(self):
        return self.sched.run_slice(self.start, lambda w: None, self.batch)

    def drain(self) -> None:
        while self.sched and self.slice() is not None:
            pass


def _submit(sched: Scheduler, s: FakeSession) -> None:
    sched.submit(s, _decode_step(), work_facts(s, _decode_step()))


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
def test_a_decode_step_waits_for_the_other_decoders_then_takes_them_along(policy):
    clock = Clock()
    sched = Scheduler(policy, batch_max=8, batch_wait_s=0.002, clock=clock)
    fake = Batches(sched)
    a, b, c = sessions = [FakeSession(x) for x in "abc"]
    for s in sessions:  # all three decode this model
        _submit(sched, s)
    fake.drain()
    assert fake.batches == [["a", "b", "c"]] and sorted(fake.ran) == ["a", "b", "c"]
    clock.now += 0.01
    # next step: a and b are back, c is not yet; they wait for it, but not for ever
    _submit(sched, a)
    _submit(sched, b)
    assert fake.slice() is None
    assert 0 < sched.wait_s() <= 0.002
    clock.now += 0.001
    _submit(sched, c)  # c arrived: the batch is complete
    fake.drain()
    assert sorted(fake.batches[-1]) == ["a", "b", "c"]
    # c stops decoding: a's next step waits batch_wait_s at most, then runs alone
    clock.now += 0.01
    _submit(sched, a)
    assert fake.slice() is None
    clock.now += 0.002
    assert sched.wait_s() == 0.0
    fake.drain()
    assert fake.ran[-1] == "a" and len(fake.batches) == 2
    # and once nobody else decoded it within DECODERS_RECENT_S, it does not wait at all
    clock.now += 2.0
    _submit(sched, a)
    assert sched.wait_s() == 0.0


def test_a_held_decode_step_lets_other_work_run_and_batches_are_capped():
    clock = Clock()
    sched = Scheduler(SemanticScheduler(), batch_max=2, batch_wait_s=0.5, clock=clock)
    fake = Batches(sched)
    a, b, c, t = (FakeSession(x) for x in "abct")
    for s in (a, b, c):
        _submit(sched, s)
    fake.slice()
    assert fake.batches == [["a", "b"]] and fake.ran == ["a"]  # batch_max
    fake.slice()
    assert fake.ran == ["a", "b"]  # a batch's members run before anything else
    assert fake.slice() is None  # c waits for a's and b's next steps
    sched.submit(t, frame(Kind.EXEC, nodes=[{}] * 10), {"kind": "EXEC", "nodes": 10})
    fake.slice()
    assert fake.ran[-1] == "t"  # the held step did not block other work
    clock.now += 0.01
    for s in (a, b):
        _submit(sched, s)
    fake.slice()
    assert fake.batches[-1] == ["c", "a"]  # the oldest first, two at most


def test_a_paused_generate_loop_is_batched_with_model_calls():
    """A generate() loop yields a DecodeStep at each token: its slice ends there, and the
    paused loop waits like a model call's decode step and joins the same batches."""
    from djinn.appliance.batching import DecodeStep, _Member

    clock = Clock()
    sched = Scheduler(SemanticScheduler(), batch_max=8, batch_wait_s=0.5, clock=clock)
    fake = Batches(sched)
    g, a = FakeSession("g"), FakeSession("a")
    tokens = []

    def loop():
        for i in range(2):
            yield DecodeStep(_Member(g, "f" * 32, None, None, None, i))
            tokens.append(i)

    fake.start = lambda work: loop() if work.session is g else iter(())
    sched.submit(g, frame(Kind.CALL, method="generate"), {"kind": "CALL", "method": "generate"})
    fake.slice()
    assert tokens == [] and sched.has(g)  # paused at its first token, the slice over
    _submit(sched, a)
    fake.drain()
    assert sorted(fake.batches[0]) == ["a", "g"]  # one batch: the loop's step and a's
    assert tokens == [0]  # resumed once, paused again at its second token
    clock.now += 1.0
    fake.drain()
    assert tokens == [0, 1] and not sched  # nobody joined: it went on alone


def test_sessions_show_their_share_of_execution_time_and_their_class():
    clock = Clock()
    sched = Scheduler(SemanticScheduler(), slice_s=1.0, clock=clock)
    a, b = FakeSession("a"), FakeSession("b")
    log: list = []
    gens = {"a": graph(clock, log, "a", 3, 0.1), "b": graph(clock, log, "b", 1, 0.1)}
    sched.submit(a, frame(Kind.EXEC), {"kind": "EXEC", "nodes": 500})
    sched.submit(b, frame(Kind.EXEC), {"kind": "EXEC", "nodes": 500})
    run_all(sched, gens, [])
    rows = sched.session_stats()
    assert rows["a"]["exec_share"] == pytest.approx(0.75, abs=0.01)
    assert rows["b"]["exec_share"] == pytest.approx(0.25, abs=0.01)
    assert (rows["a"]["exec_s"], rows["b"]["exec_s"]) == pytest.approx((0.3, 0.1), abs=1e-6)
    sched.submit(a, _decode_step(), work_facts(a, _decode_step()))
    sched.submit(b, frame(Kind.EXEC), {"kind": "EXEC", "nodes": 500})
    rows = sched.session_stats()
    assert (rows["a"]["class"], rows["b"]["class"]) == ("latency", "throughput")
    fifo = Scheduler(FifoScheduler(), clock=clock)
    fifo.submit(a, frame(Kind.EXEC), {"kind": "EXEC", "nodes": 5})
    assert fifo.session_stats()["a"]["class"] == "arrival"


def test_prometheus_has_the_batches_and_the_session_shares():
    from djinn.appliance import scheduler_metrics

    doc = {
        "scheduler": [
            {
                "worker": 0,
                "policy": "semantic",
                "batching": {"batches": 3, "calls": 10, "largest": 4},
                "tenants": {"token:alice": {"weight": 3.0, "exec_s": 1.5}},
            }
        ],
        "sessions": [{"id": "s1", "worker": 0, "exec_share": 0.4, "class": "latency"}],
    }
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in scheduler_metrics.collect(doc)
        for s in family.samples
    }
    assert samples[("djinn_scheduler_batches_total", (("what", "batches"), ("worker", "0")))] == 3
    assert samples[("djinn_scheduler_batches_total", (("what", "steps"), ("worker", "0")))] == 10
    assert samples[("djinn_scheduler_largest_batch", (("worker", "0"),))] == 4
    key = ("djinn_session_exec_share", (("class", "latency"), ("session", "s1"), ("worker", "0")))
    assert samples[key] == 0.4
    key = ("djinn_tenant_exec_seconds_total", (("tenant", "token:alice"), ("worker", "0")))
    assert samples[key] == 1.5


def test_a_request_run_at_once_is_charged_and_counted_as_its_slice():
    """Note [immediate requests]: a put or get the worker ran without queueing (nothing
    else was queued) counts in the tenants' and sessions' shares and the events as the
    one slice the queue would have given it."""
    clock = Clock()
    sched = Scheduler(SemanticScheduler(), clock=clock)
    a = FakeSession("a")
    b = FakeSession("b", peer="unix:pid=2,uid=2000")
    began = clock.now
    clock.now += 0.25
    sched.ran_alone(a, began)
    log: list = []
    sched.submit(b, frame(Kind.EXEC), {"kind": "EXEC", "nodes": 500})
    run_all(sched, {"b": graph(clock, log, "b", 1, 0.25)}, [])
    rows = sched.session_stats()
    assert (rows["a"]["exec_s"], rows["b"]["exec_s"]) == pytest.approx((0.25, 0.25))
    assert rows["a"]["exec_share"] == pytest.approx(0.5, abs=0.01)
    stats = sched.stats()
    assert (stats["completed"], stats["slices"]) == (2, 2)
    assert stats["longest_slice_s"] == pytest.approx(0.25)
    assert stats["tenants"]["uid:1000"]["exec_s"] == pytest.approx(0.25)


def test_one_immediate_request_per_visit_the_rest_wait_for_the_scheduler():
    """Note [immediate requests]: a session's pipelined puts and gets are not all run at
    once while the scheduler is empty; one is, the next is queued, so the worker's loop
    goes back to its other sockets (a client streaming 3,000 GETs held another session's
    heartbeat 130 ms). Worker.serve on a session whose reader holds three GETs."""
    from djinn.appliance.worker import Worker

    frames = [SimpleNamespace(kind=Kind.GET, body={}) for _ in range(3)]
    ran: list = []
    reader = SimpleNamespace(poll=lambda: frames.pop(0) if frames else None)
    reader.buffered = lambda: len(frames)
    session = FakeSession("a")
    session.reader, session.outbox = reader, b""
    session.sock = SimpleNamespace(fileno=lambda: 3)
    session.touch = lambda: None
    sched = Scheduler(SemanticScheduler(), clock=Clock())
    worker = SimpleNamespace(
        scheduler=sched,
        admission=SimpleNamespace(waiting=lambda sid: False),
        graphs=SimpleNamespace(size_of=lambda fp: 0),
        dispatch_steps=lambda s, f: iter(ran.append(f) or ()),
    )
    Worker.serve(worker, session)
    assert len(ran) == 1  # the first ran at once, charged as its slice
    assert sched.has(session) and len(sched) == 1  # the second waits in the queue
    assert len(frames) == 1  # the third is not read until the second has run
    assert sched.stats()["completed"] == 1
