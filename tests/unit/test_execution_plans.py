"""Note [graph plans]: a template's plan runs the same kernels on the same arguments as
the interpreted run it was recorded from, and is only used where its checks still hold.
Note [compiled plans]: so does the plan compiled to one function; the tests that take
``runner`` run both ways."""

from __future__ import annotations

import pytest
import torch

from djinn.appliance.executor import plan as plan_mod
from djinn.appliance.executor.graph import GraphRun
from djinn.appliance.executor.plan import CompiledRun, GraphPlans, PlanRun, input_signature
from djinn.appliance.vmu.device import DeviceShort, DeviceVMU, Segment
from djinn.errors import ExecutionError, NotFound, ResourceExhausted
from djinn.protocol import templates

CPU = torch.device("cpu")


class Session:
    def __init__(self, **handles: torch.Tensor) -> None:
        self.handles = handles

    def tensor(self, h: str) -> torch.Tensor:
        try:
            return self.handles[h]
        except KeyError:
            raise NotFound(h) from None


def body_of(nodes, keep=(), fetch=(), **extra):
    return {"nodes": nodes, "keep": list(keep), "fetch": list(fetch), **extra}


def interpreted(body, s: Session, stack, plans: GraphPlans | None = None, segments=()):
    """Run ``body`` as the worker runs a template's request without a plan; with
    ``plans``, recording one. (keep, fetch), and the plan if one was recorded."""
    tpl, inputs, scalars = templates.template(body)
    fp = templates.fingerprint(tpl)
    whole = templates.instantiate(tpl, inputs, scalars)
    whole["partial"] = body.get("partial") is True
    run = GraphRun(whole, s.tensor, list(segments), CPU, stack)
    run.template = fp
    signature = input_signature([s.tensor(h) for h in inputs])
    if plans is not None:
        run.recording = []
    out = run.run()
    plan = None
    if plans is not None:
        plan = plans.record(fp, tpl, run, signature, scalars, CPU)
    return out, plan, run


def planned(body, s: Session, stack, plans: GraphPlans, segments=(), runner=PlanRun):
    """The same request run by a plan (``runner``: PlanRun, or CompiledRun with the plan
    compiled first), if one fits; None otherwise."""
    tpl, inputs, scalars = templates.template(body)
    fp = templates.fingerprint(tpl)
    tensors = [s.tensor(h) for h in inputs]
    plan = plans.find(fp, input_signature(tensors), scalars)
    if plan is None:
        return None
    if runner is CompiledRun and plan.code is None:
        plan.code = plan_mod._compile_plan(plan, fp, CPU)
    request = {"graph": fp, "inputs": inputs, "scalars": scalars}
    if body.get("partial"):
        request["partial"] = True
    run = runner(plan, fp, request, inputs, tensors, s.tensor, list(segments), CPU, stack)
    return run.run(), run


RUNNERS = pytest.mark.parametrize("runner", [PlanRun, CompiledRun], ids=["plan", "compiled"])


def stack_of(capacity: int = 1 << 30) -> Segment:
    return DeviceVMU(capacity)["stack"]


def _step(lr: float, beta: float):
    """An optimizer-like graph: floats become the template's scalars."""
    return body_of(
        [
            {"op": "aten::mul.Tensor", "args": [{"$h": "g"}, {"$h": "g"}]},
            {"op": "aten::mul.Scalar", "args": [{"$h": "m"}, beta]},
            {"op": "aten::add.Tensor", "args": [{"$v": 1}, {"$v": 0}], "kwargs": {"alpha": 0.1}},
            {"op": "aten::topk.default", "args": [{"$v": 2}, 2]},
            {
                "op": "aten::sub_.Tensor",
                "args": [{"$h": "w"}, {"$h": "g"}],
                "kwargs": {"alpha": lr},
            },
            {
                "op": "aten::sum.dim_IntList",
                "args": [{"$v": 2}, [1]],
                "kwargs": {"dtype": {"$dtype": "float64"}},
            },
        ],
        keep=[{"$v": 2}],
        fetch=[{"$v": 3, "i": 1}, {"$v": 5}, {"$h": "w"}],
    )


def _session():
    torch.manual_seed(0)
    return Session(g=torch.randn(4, 5), m=torch.randn(4, 5), w=torch.randn(4, 5))


@RUNNERS
def test_a_plan_gives_what_the_interpreter_gives_with_other_scalars(runner):
    plans, stack = GraphPlans(after=1), stack_of()
    a, b = _session(), _session()
    _, plan, _ = interpreted(_step(0.1, 0.9), a, stack, plans)
    assert plan is not None and plans.recorded == 1
    interpreted(_step(0.1, 0.9), b, stack)
    for lr, beta in ((0.01, 0.99), (0.5, 0.5)):  # new floats: the same plan
        (want_keep, want_fetch), _, _ = interpreted(_step(lr, beta), a, stack)
        (got_keep, got_fetch), _ = planned(_step(lr, beta), b, stack, plans, runner=runner)
        for got, want in zip(got_keep + got_fetch, want_keep + want_fetch, strict=True):
            assert got.dtype == want.dtype and torch.equal(got, want)
    assert torch.equal(a.handles["w"], b.handles["w"])  # the in-place update happened once
    assert plans.plan_runs == 2
    assert stack.used == 0  # every stack byte released, as after an interpreted run


def test_inputs_of_another_signature_get_no_plan():
    plans, stack = GraphPlans(after=1), stack_of()
    s = _session()
    interpreted(_step(0.1, 0.9), s, stack, plans)
    other = Session(g=torch.randn(3, 5), m=torch.randn(3, 5), w=torch.randn(3, 5))
    assert planned(_step(0.1, 0.9), other, stack, plans) is None  # other sizes
    strided = Session(g=torch.randn(5, 4).t(), m=torch.randn(4, 5), w=torch.randn(4, 5))
    assert planned(_step(0.1, 0.9), strided, stack, plans) is None  # other strides
    base = torch.randn(4, 5)
    shared = Session(g=base, m=base, w=torch.randn(4, 5))
    assert planned(_step(0.1, 0.9), shared, stack, plans) is None  # two inputs, one storage
    as_double = Session(**{k: v.double() for k, v in s.handles.items()})
    assert planned(_step(0.1, 0.9), as_double, stack, plans) is None  # another dtype


@RUNNERS
def test_a_float_that_decides_a_shape_is_part_of_the_plans_key(runner):
    plans, stack = GraphPlans(after=1), stack_of()
    s = Session(x=torch.zeros(1))

    def arange(end: float):
        nodes = [
            {"op": "aten::arange.start_step", "args": [0, end, 1],
             "kwargs": {"dtype": {"$dtype": "float32"}}},
            {"op": "aten::add.Tensor", "args": [{"$v": 0}, {"$h": "x"}]},
        ]  # fmt: skip
        return body_of(nodes, fetch=[{"$v": 1}])

    interpreted(arange(5.0), s, stack, plans)
    (_, fetch), _ = planned(arange(5.0), s, stack, plans, runner=runner)
    assert torch.equal(fetch[0], torch.arange(0, 5.0, 1))
    assert (
        planned(arange(7.0), s, stack, plans, runner=runner) is None
    )  # another length: interpreted
    (_, fetch), _, _ = interpreted(arange(7.0), s, stack)
    assert fetch[0].shape == (7,)


def test_a_graph_with_data_dependent_sizes_is_never_planned():
    plans, stack = GraphPlans(after=1), stack_of()
    s = Session(x=torch.tensor([0.0, 1.0, 0.0, 2.0]))
    body = body_of([{"op": "aten::nonzero.default", "args": [{"$h": "x"}]}], fetch=[{"$v": 0}])
    tpl, _, _ = templates.template(body)
    fp = templates.fingerprint(tpl)
    assert plans.should_record(fp) is False  # first run: interpreted, not recorded
    assert plans.should_record(fp) is True
    _, plan, _ = interpreted(body, s, stack, plans)
    assert plan is None and plans.refused == 1
    assert all(plans.should_record(fp) is False for _ in range(3))  # never again


def test_a_failed_recording_run_makes_no_plan():
    plans, stack = GraphPlans(after=1), stack_of()
    s = Session(x=torch.randn(3, 4), i=torch.tensor([0, 7]))
    body = body_of(
        [
            {"op": "aten::index_select.default", "args": [{"$h": "x"}, 0, {"$h": "i"}]},
            {"op": "aten::neg.default", "args": [{"$h": "x"}]},
        ],
        fetch=[{"$v": 1}],
        partial=True,
    )
    _, plan, run = interpreted(body, s, stack, plans)
    assert run.failed is not None and plan is None and plans.recorded == 0


@RUNNERS
def test_a_plan_still_fails_where_the_kernel_refuses_values(runner):
    """Index values are not part of a plan's key: the kernel's own check still runs."""
    plans, stack = GraphPlans(after=1), stack_of()
    ok = Session(x=torch.randn(3, 4), i=torch.tensor([0, 2]))
    body = body_of(
        [{"op": "aten::index_select.default", "args": [{"$h": "x"}, 0, {"$h": "i"}]}],
        fetch=[{"$v": 0}],
    )
    interpreted(body, ok, stack, plans)
    bad = Session(x=ok.handles["x"], i=torch.tensor([0, 7]))
    with pytest.raises(ExecutionError, match="index_select"):
        planned(body, bad, stack, plans, runner=runner)
    assert stack.used == 0


def crowded() -> Segment:
    """A 1 MiB stack 900 KiB of which another request holds."""
    stack = stack_of(1 << 20)
    stack.reserve(900 << 10)
    return stack


def test_a_plan_asks_the_stack_for_the_bytes_the_checks_found():
    plans = GraphPlans(after=1)
    s = Session(x=torch.randn(256, 256))
    body = body_of([{"op": "aten::mm.default", "args": [{"$h": "x"}, {"$h": "x"}]}],
                   fetch=[{"$v": 0}])  # fmt: skip
    interpreted(body, s, stack_of(), plans)
    with pytest.raises(DeviceShort):  # short while others hold the rest: may wait
        planned(body, s, crowded(), plans)
    inplace = body_of(
        [
            {"op": "aten::add_.Tensor", "args": [{"$h": "x"}, 1]},
            {"op": "aten::mm.default", "args": [{"$h": "x"}, {"$h": "x"}]},
        ],
        fetch=[{"$v": 1}],
    )
    interpreted(inplace, s, stack_of(), plans)
    with pytest.raises(ResourceExhausted, match="wrote in place"):  # cannot wait and rerun
        planned(inplace, s, crowded(), plans)


@RUNNERS
def test_random_ops_draw_from_the_state_each_request_sends(runner):
    plans, stack = GraphPlans(after=1), stack_of()
    s = Session(x=torch.ones(8, 8))
    body = body_of(
        [{"op": "aten::native_dropout.default", "args": [{"$h": "x"}, 0.5, True], "rng": 0}],
        fetch=[{"$v": 0, "i": 0}],
    )
    states = [torch.manual_seed(k).get_state() for k in (1, 2)]
    seg = [memoryview(st.numpy()) for st in states]
    interpreted(body, s, stack, plans, segments=seg[:1])
    for k in (0, 1):
        (_, want), _, _ = interpreted(body, s, stack, segments=seg[k : k + 1])
        (_, got), _ = planned(body, s, stack, plans, segments=seg[k : k + 1], runner=runner)
        assert torch.equal(got[0], want[0])


def test_plans_are_bounded_by_their_nodes():
    plans, stack = GraphPlans(after=1, max_nodes=12), stack_of()
    for n in range(1, 6):  # five templates of 5 nodes: at most two fit
        nodes = [{"op": "aten::add.Tensor", "args": [{"$h": "x"}, n]}]
        nodes += [{"op": "aten::neg.default", "args": [{"$v": k}]} for k in range(4)]
        interpreted(body_of(nodes, fetch=[{"$v": 4}]), Session(x=torch.ones(2)), stack, plans)
    assert plans.stats()["nodes"] <= 12 and plans.stats()["plans"] == 2


@RUNNERS
def test_a_plan_runs_the_checks_that_read_values(runner):
    """Note [value checks in a plan]: a template recorded with valid targets must not take a
    crafted target past the classes straight to nll_loss_backward, which writes there
    unchecked (a SIGSEGV of the worker): plans are chosen by metadata, not values."""
    from djinn.errors import InvalidArgument

    def step():
        return body_of(
            [
                {
                    "op": "aten::nll_loss_backward.default",
                    "args": [{"$h": "g"}, {"$h": "x"}, {"$h": "t"}, None, 0, -100, {"$h": "w"}],
                }
            ],
            fetch=[{"$v": 0}],
        )

    def session(target: list[int]) -> Session:
        torch.manual_seed(0)
        return Session(
            g=torch.ones(2), x=torch.randn(2, 3), t=torch.tensor(target), w=torch.tensor(1.0)
        )

    plans, stack = GraphPlans(after=1), stack_of()
    interpreted(step(), session([0, 2]), stack, plans)
    (_, (got,)), _ = planned(step(), session([1, 2]), stack, plans, runner=runner)
    assert plans.plan_runs == 1 and got.shape == (2, 3)
    with pytest.raises(InvalidArgument, match="out of bounds"):
        planned(step(), session([0, 10**9]), stack, plans, runner=runner)


# -- Note [compiled plans] ----------------------------------------------------------------
def _chain(n: int):
    """``n`` nodes, each reading the one before: x + 1, then negations."""
    nodes = [{"op": "aten::add.Tensor", "args": [{"$h": "x"}, 1]}]
    nodes += [{"op": "aten::neg.default", "args": [{"$v": k}]} for k in range(n - 1)]
    return body_of(nodes, fetch=[{"$v": n - 1}])


def _chain_plan(n: int, plans: GraphPlans) -> tuple:
    """The plan ``plans`` records of ``_chain(n)``, and its template's fingerprint."""
    _, plan, _ = interpreted(_chain(n), Session(x=torch.ones(3)), stack_of(), plans)
    return plan, templates.fingerprint(templates.template(_chain(n))[0])


def test_plans_compile_after_their_runs_and_the_counts_say_so():
    plans = GraphPlans(after=1, compile_after=2)
    plan, fp = _chain_plan(4, plans)
    runners = [plans.runner(plan, fp, CPU) for _ in range(4)]
    assert runners == [PlanRun, PlanRun, CompiledRun, CompiledRun]
    assert plans.stats()["compiled"] == 1 and plans.stats()["compiled_runs"] == 2
    never = GraphPlans(after=1, compile_after=0)
    plan, _ = _chain_plan(4, never)
    assert {never.runner(plan, fp, CPU) for _ in range(5)} == {PlanRun}


def test_a_plan_that_cannot_be_compiled_runs_as_a_plan_and_is_counted(monkeypatch):
    from djinn.appliance.executor import plan_source

    monkeypatch.setattr(plan_source, "COMPILE_MAX_NODES", 3)
    plans, stack, s = GraphPlans(after=1, compile_after=1), stack_of(), Session(x=torch.ones(3))
    plan, fp = _chain_plan(4, plans)
    assert [plans.runner(plan, fp, CPU) for _ in range(4)] == [PlanRun] * 4
    assert plans.stats()["uncompiled"] == 1 and plans.stats()["compiled"] == 0  # tried once
    (_, (got,)), _ = planned(_chain(4), s, stack, plans)
    assert torch.equal(got, (torch.ones(3) + 1).neg().neg().neg())


def test_a_compiled_run_yields_to_the_scheduler_between_chunks():
    from djinn.appliance.executor.plan_source import CHUNK

    plans, stack, s = GraphPlans(after=1), stack_of(), Session(x=torch.ones(3))
    n = 3 * CHUNK + 1
    (_, want), _, _ = interpreted(_chain(n), s, stack, plans)
    tpl, inputs, scalars = templates.template(_chain(n))
    fp = templates.fingerprint(tpl)
    plan = plans.find(fp, input_signature([s.tensor("x")]), scalars)
    plan.code = plan_mod._compile_plan(plan, fp, CPU)
    run = CompiledRun(plan, fp, {"graph": fp, "inputs": inputs, "scalars": scalars}, inputs,
                      [s.tensor("x")], s.tensor, [], CPU, stack)  # fmt: skip
    steps, pauses = run.steps(), 0
    while True:
        try:
            next(steps)
            pauses += 1
            assert stack.used == plan.peak  # held while the run waits between chunks
        except StopIteration as stop:
            _, got = stop.value
            break
    assert pauses == 3 and torch.equal(got[0], want[0]) and stack.used == 0


def test_a_compiled_run_holds_its_peak_from_the_start_so_a_short_one_may_wait():
    """Note [compiled plans]: the stack is asked for the run's most bytes before the first
    node, so an in-place graph that is short has written nothing and may wait and run
    again (a plan run node by node would have written, and could only fail)."""
    plans = GraphPlans(after=1)
    s = Session(x=torch.randn(256, 256))
    inplace = body_of(
        [
            {"op": "aten::add_.Tensor", "args": [{"$h": "x"}, 1]},
            {"op": "aten::mm.default", "args": [{"$h": "x"}, {"$h": "x"}]},
        ],
        fetch=[{"$v": 1}],
    )
    interpreted(inplace, s, stack_of(), plans)
    before, stack = s.handles["x"].clone(), crowded()
    with pytest.raises(DeviceShort):
        planned(inplace, s, stack, plans, runner=CompiledRun)
    assert torch.equal(s.handles["x"], before)  # nothing ran
    assert stack.used == 900 << 10  # what others hold, and no more


def test_a_compiled_partial_graph_ends_where_an_interpreted_one_ends():
    def body():
        return body_of(
            [
                {"op": "aten::neg.default", "args": [{"$h": "x"}]},
                {"op": "aten::index_select.default", "args": [{"$h": "x"}, 0, {"$h": "i"}]},
                {"op": "aten::add_.Tensor", "args": [{"$h": "y"}, 1]},
            ],
            keep=[{"$v": 0}, {"$v": 1}],
            fetch=[{"$v": 0}, {"$v": 2}],
            partial=True,
        )

    plans, stack = GraphPlans(after=1), stack_of()
    x = torch.randn(3, 4)
    interpreted(body(), Session(x=x, i=torch.tensor([0, 2]), y=torch.zeros(2)), stack, plans)
    want_s = Session(x=x, i=torch.tensor([0, 7]), y=torch.zeros(2))
    got_s = Session(x=x, i=torch.tensor([0, 7]), y=torch.zeros(2))
    (want_keep, want_fetch), _, want = interpreted(body(), want_s, stack)
    (got_keep, got_fetch), got = planned(body(), got_s, stack, plans, runner=CompiledRun)
    assert got.failed[0] == want.failed[0] == 1
    assert type(got.failed[1]) is type(want.failed[1]) is ExecutionError
    assert "index_select" in got.failed[1].message
    assert torch.equal(got_keep[0], want_keep[0]) and got_keep[1] is want_keep[1] is None
    assert torch.equal(got_fetch[0], want_fetch[0]) and got_fetch[1] is want_fetch[1] is None
    assert torch.equal(got_s.handles["y"], want_s.handles["y"])  # the add_ never ran
    assert got.wrote is want.wrote is False and stack.used == 0


def test_a_cast_the_recorded_run_made_stays_in_the_compiled_run():
    """Note [statistics dtypes]: a bfloat16 layer norm's statistics as the CPU kernel
    makes them, where its meta kernel says float32: the compiled run gives the dtypes the
    interpreted run gave (which casts only where the recording saw one)."""
    plans, stack = GraphPlans(after=1), stack_of()
    s = Session(x=torch.randn(4, 8, dtype=torch.bfloat16), w=torch.randn(8, dtype=torch.bfloat16))
    body = body_of(
        [
            {
                "op": "aten::native_layer_norm.default",
                "args": [{"$h": "x"}, [8], {"$h": "w"}, None, 1e-5],
            }
        ],
        fetch=[{"$v": 0, "i": 0}, {"$v": 0, "i": 1}, {"$v": 0, "i": 2}],
    )
    (_, want), _, _ = interpreted(body, s, stack, plans)
    (_, got), _ = planned(body, s, stack, plans, runner=CompiledRun)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w)


def test_nothing_the_client_sent_is_written_into_the_compiled_source():
    """Handles, strings and floats are bound to generated names: the function's code
    holds none of them, and its namespace has no builtins."""
    handle = 'x"]); __import__("os").system("false"); #'
    s = Session(**{handle: torch.tensor([7.0, -7.0]), "d": torch.tensor([2.0, 2.0])})
    body = body_of(
        [
            {
                "op": "aten::div.Tensor_mode",
                "args": [{"$h": handle}, {"$h": "d"}],
                "kwargs": {"rounding_mode": "floor"},
            }
        ],
        fetch=[{"$v": 0}],
    )
    plans, stack = GraphPlans(after=1), stack_of()
    (_, want), _, _ = interpreted(body, s, stack, plans)
    (_, got), run = planned(body, s, stack, plans, runner=CompiledRun)
    assert torch.equal(got[0], want[0])
    code = run.plan.code
    texts = {c for c in code.__code__.co_consts if isinstance(c, str)} | set(code.__code__.co_names)
    assert not any(handle in t or "floor" in t for t in texts)
    assert code.__globals__["__builtins__"] == {}


def test_a_compiled_partial_graph_short_of_memory_ends_at_the_node_that_does_not_fit():
    """Note [partial graphs]: a partial request whose whole peak does not fit runs the
    nodes that do, as a plan run node by node does, instead of waiting whole."""
    body = body_of(
        [
            {"op": "aten::neg.default", "args": [{"$h": "x"}]},  # 4 KiB
            {"op": "aten::mm.default", "args": [{"$h": "y"}, {"$h": "y"}]},  # 256 KiB
        ],
        keep=[{"$v": 0}],
        fetch=[{"$v": 1}],
        partial=True,
    )
    plans, s = GraphPlans(after=1), Session(x=torch.ones(1024), y=torch.randn(256, 256))
    interpreted(body, s, stack_of(), plans)
    (keep, fetch), run = planned(body, s, crowded(), plans, runner=CompiledRun)
    assert torch.equal(keep[0], -torch.ones(1024)) and fetch[0] is None
    assert run.failed[0] == 1 and run.failed[1].code == "RESOURCE_EXHAUSTED"


def test_a_template_that_keeps_a_handle_as_it_is_is_never_planned():
    """A handle with more keys than "$h" stays in the template as a constant, so the
    shape of its tensor is in no signature: a plan recorded while it was small would run
    it grown, its checks and the stack's account skipped (found by a review)."""
    plans, stack = GraphPlans(after=1), stack_of()
    s = Session(h=torch.zeros(4))
    body = body_of([{"op": "aten::clone.default", "args": [{"$h": "h", "x": 0}]}],
                   fetch=[{"$v": 0}])  # fmt: skip
    _, plan, _ = interpreted(body, s, stack, plans)
    assert plan is None and plans.refused == 1
    assert planned(body, s, stack, plans) is None


def test_a_plan_whose_source_would_be_too_long_is_refused_before_it_is_written(monkeypatch):
    from djinn.appliance.executor import plan_source

    monkeypatch.setattr(plan_source, "COMPILE_MAX_CHARS", 200)
    plans = GraphPlans(after=1, compile_after=1)
    plan, fp = _chain_plan(40, plans)
    assert [plans.runner(plan, fp, CPU) for _ in range(3)] == [PlanRun] * 3
    assert plans.stats()["uncompiled"] == 1


@RUNNERS
def test_an_in_place_foreach_step_is_planned_and_gives_the_interpreters_bits(runner):
    """An op that returns nothing (``_foreach_addcdiv_``) has the meta output None; the
    recording read that as "no meta kernel" and refused every Adam(foreach=True) step."""

    def step(lr: float):
        ws, gs = [{"$h": "w0"}, {"$h": "w1"}], [{"$h": "g0"}, {"$h": "g1"}]
        return body_of(
            [
                {"op": "aten::_foreach_mul_.Scalar", "args": [gs, 0.9]},
                {"op": "aten::_foreach_addcdiv_.ScalarList", "args": [ws, gs, gs, [lr, lr]]},
                {"op": "aten::_foreach_sqrt.default", "args": [ws]},
            ],
            keep=[{"$v": 2, "i": 0}],
            fetch=[{"$h": "w0"}, {"$h": "w1"}],
        )

    def fresh():
        torch.manual_seed(0)
        return Session(w0=torch.rand(3, 4) + 1, w1=torch.rand(5) + 1, g0=torch.randn(3, 4),
                       g1=torch.randn(5))  # fmt: skip

    plans, stack = GraphPlans(after=1), stack_of()
    _, plan, _ = interpreted(step(0.01), fresh(), stack, plans)
    assert plan is not None and plans.refused == 0
    want, _, _ = interpreted(step(0.02), fresh(), stack)
    got, _ = planned(step(0.02), fresh(), stack, plans, runner=runner)
    for a, b in zip([*want[0], *want[1]], [*got[0], *got[1]], strict=True):
        assert torch.equal(a, b)


@RUNNERS
def test_a_planned_partial_failure_holds_what_the_rest_reads(runner):
    """Note [values the rest reads] (graph.py): a run that fails part way names the
    values made before the failed node that a node after it reads, and that nothing kept:
    planned and compiled runs as the interpreted one does. ``t`` (node 0) is read after
    the failure; ``u`` (node 1) is read before it only, and is gone."""
    body = body_of(
        [
            {"op": "aten::mul.Tensor", "args": [{"$h": "x"}, 2.0]},
            {"op": "aten::neg.default", "args": [{"$h": "x"}]},
            {"op": "aten::add.Tensor", "args": [{"$v": 1}, 1.0]},
            {"op": "aten::index.Tensor", "args": [{"$h": "x"}, [{"$h": "i"}]]},
            {"op": "aten::add.Tensor", "args": [{"$v": 0}, 1.0]},
        ],
        keep=[{"$v": 2}, {"$v": 4}],
        partial=True,
    )
    x = torch.arange(4.0)
    plans = GraphPlans(after=1)
    interpreted(body, Session(x=x, i=torch.tensor([1])), stack_of(), plans)
    bad = Session(x=x, i=torch.tensor([9]))
    _, _, run = interpreted(body, bad, stack_of())
    (keep, _), planned_run = planned(body, bad, stack_of(), plans, runner=runner)
    for r in (run, planned_run):
        assert r.failed[0] == 3 and r.failed[1].code == "EXECUTION_ERROR"
        held = r.held_for_rest()
        assert [ref for ref, _ in held] == [{"$v": 0}]
        assert torch.equal(held[0][1], x * 2)
    assert torch.equal(keep[0], -x + 1) and keep[1] is None
