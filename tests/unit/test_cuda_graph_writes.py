"""Note [a graph that writes its inputs] (appliance/executor/cuda_graphs.py): a training
step's plan replayed as a CUDA graph writes its weights where they are, once per call, on
the CPU stand-in capture of ``test_cuda_graphs.py``."""

from __future__ import annotations

import torch

from djinn.appliance.executor import cuda_graphs as cg
from djinn.appliance.executor.plan import CompiledRun
from djinn.protocol import templates
from tests.unit.test_cuda_graphs import CUDA, StandIn, _plan, _run, _why
from tests.unit.test_execution_plans import CPU, Session, body_of, stack_of


def _step():
    """An SGD-like step: w -= 0.5 * x in place, then the sum of the new w."""
    return body_of(
        [
            {"op": "aten::mul.Tensor", "args": [{"$h": "x"}, 0.5]},
            {"op": "aten::sub_.Tensor", "args": [{"$h": "w"}, {"$v": 0}]},
            {"op": "aten::sum.default", "args": [{"$h": "w"}]},
        ],
        fetch=[{"$v": 2}],
    )


def _stepped(s: Session, graphs: cg.CudaGraphs, plan, fp, calls: int) -> None:
    """Run the step ``calls`` times: each must move w by one step and give its new sum."""
    x = s.handles["x"]
    for i in range(calls):
        want = s.handles["w"] - x * 0.5
        (_, (got,)), _ = _run(_step(), s, plan, fp, graphs)
        assert torch.equal(s.handles["w"], want), f"call {i}: the step applied other than once"
        assert torch.equal(got, want.sum())


def test_a_step_that_writes_its_weights_is_replayed_and_applied_once_per_call():
    s = Session(x=torch.randn(4, 8), w=torch.randn(4, 8))
    plan, fp = _plan(_step(), s)
    graphs = cg.CudaGraphs(True, 1 << 30, StandIn(handles=s.handles))
    assert graphs.runner(plan, CompiledRun, CPU).__name__ == "GraphedRun"
    assert plan.cuda_graph["written"] == {1}  # x is input 0, w input 1
    _stepped(s, graphs, plan, fp, 4)
    assert graphs.captured == 1 and graphs.replays == 4
    assert plan.cuda_graph["graph"].owned == {}  # w is written where it is


def test_a_step_whose_written_input_moved_captures_again_where_it_is():
    """A new model (or another session) trains with the same plan: its weights sit
    elsewhere, and the graph writes where they are, until the captures are spent."""
    s = Session(x=torch.randn(4, 8), w=torch.randn(4, 8))
    plan, fp = _plan(_step(), s)
    graphs = cg.CudaGraphs(True, 1 << 30, StandIn(handles=s.handles))
    _stepped(s, graphs, plan, fp, 1)
    for captures in range(2, cg.MAX_CAPTURES + 1):
        s.handles["w"] = s.handles["w"].clone()  # the same values elsewhere
        _stepped(s, graphs, plan, fp, 2)
        assert graphs.captured == captures and not plan.cuda_graph["graph"].owned
    s.handles["w"] = s.handles["w"].clone()
    _stepped(s, graphs, plan, fp, 2)  # the captures are spent: compiled runs
    assert graphs.captured == cg.MAX_CAPTURES and graphs.moved == 2
    assert graphs.replays == 1 + 2 * (cg.MAX_CAPTURES - 1)
    assert graphs.why == {"runs compiled: its inputs move from run to run (3 captures)": 2}


def test_a_replay_that_writes_its_inputs_says_so():
    """Note [rerunnable graphs]: a request that wrote in place is not queued to run again
    when the memory for its results is short (it would apply the step twice)."""
    s = Session(x=torch.randn(4, 8), w=torch.randn(4, 8))
    plan, fp = _plan(_step(), s)
    graphs = cg.CudaGraphs(True, 1 << 30, StandIn(handles=s.handles))
    _, inputs, scalars = templates.template(_step())
    for _ in range(2):  # captured, then replayed
        runner = graphs.runner(plan, CompiledRun, CPU)
        request = {"graph": fp, "inputs": inputs, "scalars": scalars}
        tensors = [s.tensor(h) for h in inputs]
        run = runner(plan, fp, request, inputs, tensors, s.tensor, [], CPU, stack_of())
        run.run()
        assert run.wrote
    assert graphs.replays == 2


def test_a_written_input_another_input_views_is_written_where_it_is():
    """Parameters can be views of one storage: the warm-up writes a copy, the replay the
    storage itself, and what reads it afterwards reads the write."""
    w = torch.randn(4, 8)
    body = body_of(
        [
            {"op": "aten::sub_.Tensor", "args": [{"$h": "w"}, 1.0]},
            {"op": "aten::sum.default", "args": [{"$h": "v"}]},
        ],
        fetch=[{"$v": 1}],
    )
    s = Session(w=w, v=w[1])
    plan, fp = _plan(body, s)
    graphs = cg.CudaGraphs(True, 1 << 30, StandIn(handles=s.handles))
    for _ in range(3):
        want = w - 1.0
        (_, (got,)), _ = _run(body, s, plan, fp, graphs)
        assert torch.equal(w, want) and torch.equal(got, want[1].sum())
    assert graphs.captured == 1 and graphs.replays == 3


def test_a_step_whose_written_inputs_are_too_big_to_copy_is_not_captured():
    s = Session(x=torch.randn(4, 8), w=torch.randn(4, 8))
    plan, fp = _plan(_step(), s)
    graphs = cg.CudaGraphs(True, cg.pool_bytes(plan.peak) + 4 * 8 * 4 - 1, StandIn())
    _stepped(s, graphs, plan, fp, 2)
    assert graphs.refused == 1 and graphs.captured == 0 and plan.cuda_graph is False
    assert graphs.stats()["why"] == {
        "the 128 bytes of inputs it writes are over cuda_graph_bytes": 1
    }


def test_an_index_guard_that_reads_an_input_the_plan_wrote_before_it_does_not_qualify():
    """The guard's prefix runs before the replay, on the inputs as they are then."""
    handles = {"ids": torch.tensor([0, 1, 2]), "wte": torch.randn(4, 2)}
    through_a_clone = [
        {"op": "aten::add_.Scalar", "args": [{"$h": "ids"}, 1]},
        {"op": "aten::clone.default", "args": [{"$h": "ids"}]},
        {"op": "aten::embedding.default", "args": [{"$h": "wte"}, {"$v": 1}]},
    ]
    through_a_view = [
        {"op": "aten::view.default", "args": [{"$h": "ids"}, [-1]]},
        {"op": "aten::add_.Scalar", "args": [{"$v": 0}, 1]},
        {"op": "aten::embedding.default", "args": [{"$h": "wte"}, {"$v": 0}]},
    ]
    directly = [
        {"op": "aten::add_.Scalar", "args": [{"$h": "ids"}, 1]},
        {"op": "aten::embedding.default", "args": [{"$h": "wte"}, {"$h": "ids"}]},
    ]
    for nodes in (through_a_clone, through_a_view, directly):
        q = _why(nodes, device=CUDA, **{k: t.clone() for k, t in handles.items()})
        assert q.why == "an index guard reads an input the plan writes"
    # two inputs over one storage: the plan writes one, the guard's prefix reads the other
    ids = torch.tensor([0, 1, 2])
    other_input = [
        {"op": "aten::add_.Scalar", "args": [{"$h": "a"}, 1]},
        {"op": "aten::clone.default", "args": [{"$h": "b"}]},
        {"op": "aten::embedding.default", "args": [{"$h": "wte"}, {"$v": 1}]},
    ]
    q = _why(other_input, device=CUDA, a=ids, b=ids.view(3), wte=torch.randn(4, 2))
    assert q.why == "an index guard reads an input the plan writes"
    # written after the guard read it: the prefix sees what the graph sees
    after = [
        {"op": "aten::clone.default", "args": [{"$h": "ids"}]},
        {"op": "aten::embedding.default", "args": [{"$h": "wte"}, {"$v": 0}]},
        {"op": "aten::add_.Scalar", "args": [{"$h": "ids"}, 1]},
    ]
    q = _why(after, device=CUDA, **handles)
    assert q.why is None and q.prefix == [0] and q.written == {0}


def test_the_warm_up_copies_keep_a_written_views_offset():
    """``as_strided`` of a written input that is a view at offset 2 of a shared storage:
    the warm-up's copy is the same view of a copy of that storage (a plain clone starts at
    offset 0, and the capture failed reading past it)."""
    body = body_of(
        [
            {"op": "aten::as_strided.default", "args": [{"$h": "v"}, [2], [1], 3]},
            {"op": "aten::add_.Tensor", "args": [{"$v": 0}, 1]},
            {"op": "aten::sum.default", "args": [{"$h": "w"}]},
        ],
        fetch=[{"$v": 2}],
    )
    w = torch.arange(8.0)
    s = Session(w=w, v=w[2:6])
    plan, fp = _plan(body, s)
    graphs = cg.CudaGraphs(True, 1 << 30, StandIn(handles=s.handles))
    for _ in range(3):
        want = w.clone()
        want[3:5] += 1
        (_, (got,)), _ = _run(body, s, plan, fp, graphs)
        assert torch.equal(w, want) and torch.equal(got, want.sum())
    assert graphs.captured == 1 and graphs.failed == 0 and graphs.replays == 3
