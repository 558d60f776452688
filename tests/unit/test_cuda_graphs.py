"""Note [CUDA graphs for plans]: which compiled plans a GPU worker replays as one CUDA graph,
and that a replay gives what the compiled run gives, for every run after it too.

On a CPU, the capture is a stand-in with a CUDA graph's semantics: the captured run's
inputs and outputs are its buffers, and a replay runs the plan again on those inputs and
writes its results into those outputs. The CUDA capture itself runs in the gpu-marked
``tests/integration/test_gpu.py``."""

from __future__ import annotations

import pytest
import torch

from djinn.appliance.executor import cuda_graphs as cg
from djinn.appliance.executor import plan as plan_mod
from djinn.appliance.executor.metacheck import tensors_of
from djinn.appliance.executor.plan import CompiledRun, GraphPlans, PlanRun, input_signature
from djinn.errors import DjinnError, ExecutionError
from djinn.protocol import templates
from tests.unit.test_execution_plans import CPU, Session, body_of, interpreted, stack_of

CUDA = torch.device("cuda")  # only named: qualifies() reads the device's type


class StandIn(cg.Capture):
    """Capture = the warm-up, then one run whose values are the graph's buffers; replay =
    run again on the captured inputs and write the results into those buffers. As a CUDA
    capture computes nothing, the capturing run leaves the ``handles`` it is given as it
    found them (Note [a graph that writes its inputs])."""

    def __init__(self, fail: bool = False, handles: dict | None = None) -> None:
        self.fail, self.replays, self.handles = fail, 0, handles or {}

    def supports(self, device: torch.device) -> bool:
        return True

    def capture(self, device, warm, run):
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        warm()
        before = {k: t.clone() for k, t in self.handles.items()}
        values = run()
        for k, t in before.items():
            self.handles[k].copy_(t)
        return (run, values), values

    def replay(self, graph) -> None:
        run, values = graph
        self.replays += 1
        for old, new in zip(values, run(), strict=True):
            for o, n in zip(tensors_of(old), tensors_of(new), strict=True):
                o.copy_(n)


def _forward(scale: float = 2.0):
    """x @ w, scaled, then a ReLU: a forward that writes nothing it was given."""
    return body_of(
        [
            {"op": "aten::mm.default", "args": [{"$h": "x"}, {"$h": "w"}]},
            {"op": "aten::mul.Tensor", "args": [{"$v": 0}, scale]},
            {"op": "aten::relu.default", "args": [{"$v": 1}]},
        ],
        keep=[{"$v": 2}],
        fetch=[{"$v": 1}],
    )


def _plan(body, s: Session, compile_it: bool = True):
    plans = GraphPlans(after=1)
    _, plan, _ = interpreted(body, s, stack_of(), plans)
    fp = templates.fingerprint(templates.template(body)[0])
    if compile_it:
        plan.code = plan_mod._compile_plan(plan, fp, CPU)
    return plan, fp


def _run(body, s: Session, plan, fp, graphs: cg.CudaGraphs):
    """The request ``body`` as a worker runs it with ``graphs``: (keep, fetch), runner."""
    _, inputs, scalars = templates.template(body)
    tensors = [s.tensor(h) for h in inputs]
    assert plan.fits(input_signature(tensors), scalars)
    runner = graphs.runner(plan, CompiledRun, CPU)
    request = {"graph": fp, "inputs": inputs, "scalars": scalars}
    run = runner(plan, fp, request, inputs, tensors, s.tensor, [], CPU, stack_of())
    return run.run(), runner


def _eager(x, w, scale=2.0):
    mid = (x @ w) * scale
    return mid.relu(), mid


def _session(seed: int = 0) -> Session:
    gen = torch.Generator().manual_seed(seed)
    return Session(x=torch.randn(4, 8, generator=gen), w=torch.randn(8, 3, generator=gen))


def test_a_forward_is_captured_once_then_replayed_with_the_compiled_runs_bits():
    s = _session()
    plan, fp = _plan(_forward(), s)
    stand_in = StandIn()
    graphs = cg.CudaGraphs(True, 1 << 30, stand_in)
    outs = []
    for _ in range(3):
        ((kept,), (fetched,)), runner = _run(_forward(), s, plan, fp, graphs)
        assert runner.__name__ == "GraphedRun"
        outs.append((kept, fetched))
    want = _eager(s.handles["x"], s.handles["w"])
    for kept, fetched in outs:
        assert torch.equal(kept, want[0]) and torch.equal(fetched, want[1])
    assert graphs.stats() | {"bytes": 0} == {
        "graphs": 1, "bytes": 0, "captured": 1, "replays": 3, "failed": 0, "refused": 0,
        "why": {}, "moved": 0,
    }  # fmt: skip
    assert stand_in.replays == 3  # the capturing run replays too: a capture computes nothing


def test_results_a_session_holds_are_not_overwritten_by_the_next_replay():
    s = _session()
    plan, fp = _plan(_forward(), s)
    graphs = cg.CudaGraphs(True, 1 << 30, StandIn())
    ((first,), _), _ = _run(_forward(), s, plan, fp, graphs)
    kept = first.clone()
    s.handles["w"].mul_(-1)  # the same tensor, new values: the graph reads them where they are
    ((second,), _), _ = _run(_forward(), s, plan, fp, graphs)
    assert torch.equal(first, kept)
    assert torch.equal(second, _eager(s.handles["x"], s.handles["w"])[0])
    assert graphs.captured == 1


def test_an_input_that_moves_is_copied_into_the_graphs_own_buffer():
    s = _session()
    plan, fp = _plan(_forward(), s)
    graphs = cg.CudaGraphs(True, 1 << 30, StandIn())
    _run(_forward(), s, plan, fp, graphs)
    for seed in (1, 2, 3, 4):  # a new activation each call; the weight stays
        s.handles["x"] = _session(seed).handles["x"]
        ((kept,), _), _ = _run(_forward(), s, plan, fp, graphs)
        assert torch.equal(kept, _eager(s.handles["x"], s.handles["w"])[0])
    state = plan.cuda_graph
    assert list(state["graph"].owned) == [0]  # x is input 0; w is read where it is
    assert graphs.captured == 2 and graphs.moved == 0
    assert graphs.bytes == cg.pool_bytes(plan.peak) + 4 * 8 * 4


def test_other_scalars_capture_again_once_they_repeat_at_most_three_times():
    """A run with new scalars runs compiled; the next with the same ones captures them. A
    schedule that changes them at every run (a default Adam's followed step) is captured
    once, not three times."""
    s = _session()
    plan, fp = _plan(_forward(2.0), s)
    graphs = cg.CudaGraphs(True, 1 << 30, StandIn())
    captured = []
    for scale in (2.0, 3.0, 3.0, 4.0, 4.0, 5.0, 5.0, 2.0):
        ((kept,), _), _ = _run(_forward(scale), s, plan, fp, graphs)
        assert torch.equal(kept, _eager(s.handles["x"], s.handles["w"], scale)[0])
        captured.append(graphs.captured)
    assert captured == [1, 1, 2, 2, 3, 3, 3, 3]
    assert graphs.moved == 3  # 5.0 twice, then 2.0 again (the last graph holds 4.0)
    assert graphs.stats()["graphs"] == 1
    assert graphs.why == {
        "runs compiled: its scalars changed since the run before": 2,
        "runs compiled: its scalars change from run to run (3 captures)": 3,
    }


def test_scalars_that_change_at_every_run_are_captured_once():
    s = _session()
    plan, fp = _plan(_forward(2.0), s)
    graphs = cg.CudaGraphs(True, 1 << 30, StandIn())
    for k in range(8):
        scale = 2.0 + k / 8
        ((kept,), _), _ = _run(_forward(scale), s, plan, fp, graphs)
        assert torch.equal(kept, _eager(s.handles["x"], s.handles["w"], scale)[0])
    assert graphs.captured == 1 and graphs.replays == 1
    assert graphs.why == {"runs compiled: its scalars changed since the run before": 7}


def test_a_failed_capture_is_counted_and_the_plan_runs_compiled():
    s = _session()
    plan, fp = _plan(_forward(), s)
    graphs = cg.CudaGraphs(True, 1 << 30, StandIn(fail=True))
    for _ in range(2):
        ((kept,), _), _ = _run(_forward(), s, plan, fp, graphs)
        assert torch.equal(kept, _eager(s.handles["x"], s.handles["w"])[0])
    assert graphs.failed == 1 and graphs.captured == 0 and plan.cuda_graph is False
    assert graphs.runner(plan, CompiledRun, CPU) is CompiledRun
    assert graphs.stats()["why"] == {
        "capture failed: RuntimeError: operation not permitted when stream is capturing": 1
    }


def test_a_kept_view_of_an_input_is_not_captured():
    body = body_of(
        [
            {"op": "aten::view.default", "args": [{"$h": "x"}, [32]]},
            {"op": "aten::sum.default", "args": [{"$h": "x"}]},
        ],
        keep=[{"$v": 0}],
        fetch=[{"$v": 1}],
    )
    s = _session()
    plan, fp = _plan(body, s)
    graphs = cg.CudaGraphs(True, 1 << 30, StandIn())
    (kept, _), _ = _run(body, s, plan, fp, graphs)
    assert kept[0].untyped_storage().data_ptr() == s.handles["x"].untyped_storage().data_ptr()
    assert graphs.failed == 1  # the compiled run kept the view, as eager does


def test_the_graphs_together_stay_within_their_bytes():
    graphs = cg.CudaGraphs(True, 1 << 30, StandIn())
    runs = []
    for extra in (0, 1):  # two templates: the second has one more node
        body = _forward()
        body["nodes"] += [{"op": "aten::neg.default", "args": [{"$v": 2}]}] * extra
        s = _session()
        plan, fp = _plan(body, s)
        runs.append((body, s, plan, fp))
    one = cg.pool_bytes(runs[1][2].peak)
    graphs.max_bytes = cg.pool_bytes(runs[0][2].peak) + one - 1  # room for one of the two
    for body, s, plan, fp in runs:
        _run(body, s, plan, fp, graphs)
    assert graphs.stats()["graphs"] == 1 and graphs.bytes == one
    assert runs[0][2].cuda_graph["graph"] is None  # let go; captured again when it returns
    graphs.forget([runs[1][2]])
    assert graphs.bytes == 0 and graphs.stats()["graphs"] == 0


def test_only_a_compiled_plan_on_a_device_the_capture_supports_is_graphed():
    s = _session()
    plan, _ = _plan(_forward(), s)
    assert cg.CudaGraphs(True, 1 << 30).runner(plan, CompiledRun, CPU) is CompiledRun
    assert cg.CudaGraphs(False, 1 << 30, StandIn()).runner(plan, CompiledRun, CPU) is CompiledRun
    assert cg.CudaGraphs(True, 1 << 30, StandIn()).runner(plan, PlanRun, CPU) is PlanRun
    too_big = cg.CudaGraphs(True, cg.pool_bytes(plan.peak) - 1, StandIn())
    assert too_big.runner(plan, CompiledRun, CPU) is CompiledRun and too_big.refused == 1


# -- which plans qualify ---------------------------------------------------------------------
def _why(nodes, keep=(), fetch=(), device=CPU, **handles):
    body = body_of(nodes, keep=keep, fetch=fetch or [{"$v": len(nodes) - 1}])
    plan, _ = _plan(body, Session(**handles), compile_it=False)
    return cg.qualifies(plan, device)


def test_the_inputs_a_plan_writes_into_directly_or_through_a_view_are_known():
    x, y = torch.ones(4, 4), torch.ones(4)
    q = _why([{"op": "aten::add_.Tensor", "args": [{"$h": "x"}, 1]}], x=x)
    assert q.why is None and q.written == {0}
    q = _why(
        [
            {"op": "aten::select.int", "args": [{"$h": "y"}, 0, 1]},
            {"op": "aten::mul_.Scalar", "args": [{"$v": 0}, 2]},
            {"op": "aten::add.Tensor", "args": [{"$h": "x"}, 1]},
        ],
        y=y,
        x=x,
    )
    assert q.why is None and q.written == {0}  # y, the first input named
    # into what the plan made: no input written
    q = _why(
        [
            {"op": "aten::clone.default", "args": [{"$h": "x"}]},
            {"op": "aten::mul_.Scalar", "args": [{"$v": 0}, 2]},
        ],
        x=x,
    )
    assert q.why is None and q.written == frozenset()


def test_random_ops_and_inline_bytes_do_not_qualify():
    x = torch.ones(4, 4)
    why, *_ = _why([{"op": "aten::rand_like.default", "args": [{"$h": "x"}]}], x=x)
    assert "random" in why
    inline = {"$t": 0, "desc": {"dtype": "float32", "shape": [4], "strides": [1]}}
    body = body_of([{"op": "aten::add.Tensor", "args": [{"$h": "x"}, inline]}], fetch=[{"$v": 0}])
    s = Session(x=torch.ones(4))
    segment = memoryview(bytearray(torch.arange(4.0).numpy().tobytes()))
    plans = GraphPlans(after=1)
    _, plan, _ = interpreted(body, s, stack_of(), plans, segments=[segment])
    assert "inline tensor" in cg.qualifies(plan, CPU)[0]


def test_on_a_gpu_the_index_guards_are_checked_before_each_replay_on_their_prefix():
    """GPT-2's start: token ids (a view of an input) and position ids (arange written into
    an empty tensor) go into embeddings, whose guards read them."""
    nodes = [
        {"op": "aten::view.default", "args": [{"$h": "ids"}, [-1, 4]]},
        {"op": "aten::embedding.default", "args": [{"$h": "wte"}, {"$v": 0}]},
        {
            "op": "aten::empty_strided.default",
            "args": [[0], [1]],
            "kwargs": {"dtype": {"$dtype": "int64"}},
        },
        {"op": "aten::arange.start_out", "args": [0, 4], "kwargs": {"out": {"$v": 2}}},
        {"op": "aten::unsqueeze.default", "args": [{"$v": 2}, 0]},
        {"op": "aten::embedding.default", "args": [{"$h": "wpe"}, {"$v": 4}]},
        {"op": "aten::add.Tensor", "args": [{"$v": 1}, {"$v": 5}]},
    ]
    handles = {"ids": torch.tensor([[1, 2, 3, 0]]), "wte": torch.randn(5, 2),
               "wpe": torch.randn(4, 2)}  # fmt: skip
    why, prefix, guards, _ = _why(nodes, device=CUDA, **handles)
    assert why is None and guards == [1, 5]
    assert prefix == [0, 2, 3, 4]  # the arange that wrote into node 2's tensor included
    why, prefix, guards, _ = _why(nodes, device=CPU, **handles)
    assert why is None and guards == [] and prefix == []  # a CPU kernel checks as it goes


def test_a_guard_on_a_value_the_whole_graph_computes_does_not_qualify(monkeypatch):
    monkeypatch.setattr(cg, "PREFIX_NODES", 2)
    nodes = [
        {"op": "aten::view.default", "args": [{"$h": "ids"}, [-1]]},
        {"op": "aten::add.Tensor", "args": [{"$v": 0}, 0]},
        {"op": "aten::remainder.Scalar", "args": [{"$v": 1}, 5]},
        {"op": "aten::embedding.default", "args": [{"$h": "wte"}, {"$v": 2}]},
    ]
    why, *_ = _why(nodes, device=CUDA, ids=torch.tensor([[1, 2]]), wte=torch.randn(5, 2))
    assert "too many nodes" in why


# -- found by a review: each of these gave a replay other than the compiled run's ----------
@pytest.mark.parametrize("view", ["aten::_unsafe_view.default", "aten::unsafe_split.Tensor"])
def test_a_write_through_a_view_its_schema_does_not_declare_writes_the_input(view):
    args = [{"$h": "x"}, [8]] if "view" in view else [{"$h": "x"}, 8]
    written = {"$v": 0} if "view" in view else {"$v": 0, "i": 0}
    q = _why(
        [
            {"op": view, "args": args},
            {"op": "aten::add_.Scalar", "args": [written, 1]},
            {"op": "aten::sum.default", "args": [{"$v": 1}]},
        ],
        x=torch.zeros(2, 4),
    )
    assert q.written == {0}


def test_scalars_are_matched_by_their_bits():
    """0.0 == -0.0 in Python, not to a kernel: x / -0.0 is -inf."""

    def body(v: float):
        return body_of([{"op": "aten::div.Scalar", "args": [{"$h": "x"}, v]}], fetch=[{"$v": 0}])

    s = Session(x=torch.ones(3))
    plan, fp = _plan(body(0.0), s)
    graphs = cg.CudaGraphs(True, 1 << 30, StandIn())
    (_, (a,)), _ = _run(body(0.0), s, plan, fp, graphs)
    (_, (b,)), _ = _run(body(-0.0), s, plan, fp, graphs)  # new scalars: compiled
    (_, (c,)), _ = _run(body(-0.0), s, plan, fp, graphs)  # the same again: captured
    assert a.tolist() == [float("inf")] * 3
    assert b.tolist() == c.tolist() == [float("-inf")] * 3
    assert graphs.captured == 2 and graphs.replays == 2


def _with_gpu_guards(monkeypatch, graphs: cg.CudaGraphs) -> None:
    """The index guards a GPU worker runs (Note [indices on a GPU]), on this CPU run."""
    from djinn.appliance.executor import index_bounds

    monkeypatch.setattr(
        graphs.run_class, "_extra_checks", lambda self, op, named: index_bounds.check(op, named)
    )


def test_a_guard_whose_indices_another_guard_computes_is_checked_on_them(monkeypatch):
    body = body_of(
        [
            {"op": "aten::index_select.default", "args": [{"$h": "table"}, 0, {"$h": "ids"}]},
            {"op": "aten::embedding.default", "args": [{"$h": "wte"}, {"$v": 0}]},
        ],
        fetch=[{"$v": 1}],
    )
    s = Session(
        table=torch.tensor([3, 1, 0, 2]), ids=torch.tensor([0, 2, 1]), wte=torch.randn(4, 2)
    )
    plan, fp = _plan(body, s)
    why, prefix, guards, _ = cg.qualifies(plan, CUDA)
    assert why is None and guards == [0, 1] and prefix == [0]
    plan.cuda_graph = {"prefix": prefix, "guards": guards, "graph": None, "captures": 0,
                       "written": frozenset()}  # fmt: skip
    graphs = cg.CudaGraphs(True, 1 << 30, StandIn())
    _with_gpu_guards(monkeypatch, graphs)
    (_, (got,)), _ = _run(body, s, plan, fp, graphs)
    assert torch.equal(got, s.handles["wte"][s.handles["table"][s.handles["ids"]]])
    s.handles["table"][2] = 9  # row 9 of a 4-row table, through the first guard's output
    with pytest.raises(DjinnError, match="index 9 is out of bounds"):
        _run(body, s, plan, fp, graphs)


def test_a_write_between_two_guards_is_in_the_second_guards_prefix(monkeypatch):
    body = body_of(
        [
            {"op": "aten::clone.default", "args": [{"$h": "ids"}]},
            {"op": "aten::embedding.default", "args": [{"$h": "wte"}, {"$v": 0}]},
            {"op": "aten::add_.Tensor", "args": [{"$v": 0}, {"$h": "shift"}]},
            {"op": "aten::embedding.default", "args": [{"$h": "wte"}, {"$v": 0}]},
        ],
        fetch=[{"$v": 3}],
    )
    s = Session(ids=torch.tensor([0, 1, 2]), shift=torch.tensor([0, 0, 0]), wte=torch.randn(4, 2))
    plan, fp = _plan(body, s)
    why, prefix, guards, _ = cg.qualifies(plan, CUDA)
    assert why is None and guards == [1, 3] and prefix == [0, 2]
    plan.cuda_graph = {"prefix": prefix, "guards": guards, "graph": None, "captures": 0,
                       "written": frozenset()}  # fmt: skip
    graphs = cg.CudaGraphs(True, 1 << 30, StandIn())
    _with_gpu_guards(monkeypatch, graphs)
    _run(body, s, plan, fp, graphs)  # captured
    s.handles["shift"].copy_(torch.tensor([0, 0, 5]))  # 2 + 5: row 7 of 4, after the write
    with pytest.raises(DjinnError, match="index 7 is out of bounds"):
        _run(body, s, plan, fp, graphs)  # the guard says so: the kernel never sees it


def test_a_prefix_node_that_fails_fails_the_request_with_a_typed_error(monkeypatch):
    body = body_of(
        [
            {"op": "aten::clone.default", "args": [{"$h": "ids"}]},
            {"op": "aten::embedding.default", "args": [{"$h": "wte"}, {"$v": 0}]},
        ],
        fetch=[{"$v": 1}],
    )
    s = Session(ids=torch.tensor([0, 1, 2]), wte=torch.randn(4, 2))
    plan, fp = _plan(body, s)
    why, prefix, guards, _ = cg.qualifies(plan, CUDA)
    assert why is None and prefix == [0]
    plan.cuda_graph = {"prefix": prefix, "guards": guards, "graph": None, "captures": 0,
                       "written": frozenset()}  # fmt: skip
    graphs = cg.CudaGraphs(True, 1 << 30, StandIn())
    _with_gpu_guards(monkeypatch, graphs)

    def refuses(*args, **kwargs):
        raise RuntimeError("the kernel refuses")

    monkeypatch.setattr(plan.nodes[0], "op", refuses)
    with pytest.raises(ExecutionError, match="node 0"):
        _run(body, s, plan, fp, graphs)


# -- the stats' reasons, and kept views -------------------------------------------------------
def test_the_reasons_counted_are_bounded(monkeypatch):
    monkeypatch.setattr(cg, "WHYS", 2)
    graphs = cg.CudaGraphs(True, 1 << 30, StandIn())
    for why in ("a", "b", "a", "c", "d"):
        graphs.count_why(why)
    assert graphs.stats()["why"] == {"a": 2, "b": 1, "other reasons": 2}


def test_a_kept_view_of_the_graphs_own_buffer_keeps_its_strides_and_its_values():
    """A weight's gradient is the transpose of a matrix product: kept as that view."""
    body = body_of(
        [
            {"op": "aten::mm.default", "args": [{"$h": "x"}, {"$h": "w"}]},
            {"op": "aten::t.default", "args": [{"$v": 0}]},
            {"op": "aten::slice.Tensor", "args": [{"$v": 1}, 1, 1, 3]},
        ],
        keep=[{"$v": 2}],
        fetch=[{"$v": 2}],
    )
    s = _session()
    plan, fp = _plan(body, s)
    graphs = cg.CudaGraphs(True, 1 << 30, StandIn())
    ((compiled,), _), _ = _run(body, s, plan, fp, cg.CudaGraphs(False, 0))
    kept = []
    for k in range(3):
        s.handles["w"].add_(1)
        ((got,), _), _ = _run(body, s, plan, fp, graphs)
        assert (got.stride(), got.storage_offset()) == (
            compiled.stride(),
            compiled.storage_offset(),
        )
        assert got.untyped_storage().nbytes() == compiled.untyped_storage().nbytes()
        kept.append((got, got.clone()))
        assert torch.equal(got, (s.handles["x"] @ s.handles["w"]).t()[:, 1:3]), k
    for got, then in kept:  # a later replay did not overwrite what an earlier one gave
        assert torch.equal(got, then)
    assert graphs.captured == 1 and graphs.failed == 0 and graphs.replays == 3


def test_results_copied_out_of_the_graph_keep_their_layout_and_own_their_storage():
    """Whole tensors are copied together (one ``_foreach_copy_``), a view with its storage;
    nested tuples and lists and non-tensors keep their shape."""
    from djinn.appliance.executor.graph_buffers import copied

    base = torch.arange(24.0).reshape(4, 6)
    view = base.t()[1:3]  # strided, offset 1
    whole = [torch.randn(3, 5), torch.arange(4), torch.tensor(True), torch.empty(0)]
    values = [whole[0], (whole[1], 7), [view, whole[2]], "x", whole[3]]
    got = copied(values)
    assert got[3] == "x" and got[1][1] == 7 and isinstance(got[1], tuple)
    pairs = [(got[0], whole[0]), (got[1][0], whole[1]), (got[2][1], whole[2]),
             (got[4], whole[3]), (got[2][0], view)]  # fmt: skip
    for out, src in pairs:
        assert torch.equal(out, src) and out.dtype == src.dtype
        assert (out.stride(), out.storage_offset()) == (src.stride(), src.storage_offset())
        assert out.untyped_storage().nbytes() == src.untyped_storage().nbytes()
        if src.numel():
            assert out.untyped_storage().data_ptr() != src.untyped_storage().data_ptr()
    base.zero_()
    whole[0].zero_()
    assert got[2][0].abs().sum() > 0 and got[0].abs().sum() > 0  # copies, not aliases


def test_results_with_a_conjugate_or_negative_bit_or_a_rare_dtype_are_copied_as_they_read():
    """The bits are not in the storage: a kept ``_conj`` of a slice read back unconjugated
    (a review, on the stand-in capture). uint16 has no kernel on CUDA's one-launch path."""
    from djinn.appliance.executor.graph_buffers import copied

    z = torch.randn(4, 3, dtype=torch.complex64)
    values = [z.conj(), z[1:3].conj(), z[0]._neg_view(), z._neg_view(),
              torch.tensor([1, 2, 60000], dtype=torch.int32).to(torch.uint16)]  # fmt: skip
    for out, src in zip(copied(values), values, strict=True):
        assert torch.equal(out.resolve_conj().resolve_neg().to(torch.complex128),
                           src.resolve_conj().resolve_neg().to(torch.complex128))  # fmt: skip
        assert (out.stride(), out.storage_offset()) == (src.stride(), src.storage_offset())
        assert out.untyped_storage().data_ptr() != src.untyped_storage().data_ptr()


@pytest.mark.gpu
def test_results_of_every_wire_dtype_are_copied_out_on_a_gpu():
    """CUDA's ``_foreach_copy_`` takes its one-launch path whenever a list has one dtype,
    and has kernels for some dtypes only: each dtype the protocol carries is copied out
    of the graph's buffers with its bits, alone in a list as a plan's results may be."""
    from djinn.appliance.executor.graph_buffers import copied
    from djinn.protocol.tensors import DTYPES

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    raw = torch.arange(64, dtype=torch.uint8, device="cuda") % 2  # valid in every dtype
    for name, dtype in DTYPES.items():
        size = torch.empty((), dtype=dtype).element_size()
        src = [raw[: 4 * size].clone().view(dtype), raw[: 8 * size].clone().view(dtype)]
        out = copied(src)
        for o, s in zip(out, src, strict=True):
            assert o.dtype == dtype and o.shape == s.shape, name
            assert torch.equal(o.view(torch.uint8), s.view(torch.uint8)), name
            assert o.untyped_storage().data_ptr() != s.untyped_storage().data_ptr(), name
