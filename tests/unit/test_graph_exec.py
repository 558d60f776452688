"""The op-graph interpreter: only aten/prims run, references are checked, constants decode."""

from __future__ import annotations

import pytest
import torch

from djinn.appliance.executor.graph import GraphRun, resolve_op
from djinn.appliance.vmu.device import DeviceVMU
from djinn.errors import ExecutionError, InvalidArgument, NotFound, ResourceExhausted, UnsupportedOp

HANDLES = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2, 3)}


def _lookup(h: str) -> torch.Tensor:
    try:
        return HANDLES[h]
    except KeyError:
        raise NotFound(h) from None


def run(nodes, keep=(), fetch=(), stack_capacity=1 << 30):
    stack = DeviceVMU(stack_capacity)["stack"]
    g = GraphRun(
        {"nodes": nodes, "keep": list(keep), "fetch": list(fetch)},
        _lookup,
        [],
        torch.device("cpu"),
        stack,
    )
    out = g.run()
    assert stack.used == 0, "every stack byte is released when the run ends"
    return out, stack


def test_graph_of_aten_ops_matches_eager():
    nodes = [
        {"op": "aten::add.Tensor", "args": [{"$h": "a"}, {"$h": "b"}], "kwargs": {"alpha": 2}},
        {"op": "aten::softmax.int", "args": [{"$v": 0}, -1]},
        {
            "op": "aten::sum.dim_IntList",
            "args": [{"$v": 1}, [1]],
            "kwargs": {"dtype": {"$dtype": "float64"}},
        },
    ]
    (keep, fetch), stack = run(nodes, keep=[{"$v": 1}], fetch=[{"$v": 2}])
    expected = torch.softmax(HANDLES["a"] + 2 * HANDLES["b"], -1)
    assert torch.equal(keep[0], expected)
    assert torch.equal(fetch[0], expected.sum(1, dtype=torch.float64))
    assert stack.peak > 0


def test_tuple_outputs_are_indexed():
    nodes = [
        {"op": "aten::topk.default", "args": [{"$h": "a"}, 2]},
        {"op": "aten::neg.default", "args": [{"$v": 0, "i": 1}]},
    ]
    (_, fetch), _ = run(nodes, fetch=[{"$v": 1}])
    assert torch.equal(fetch[0], -HANDLES["a"].topk(2).indices)


def test_tagged_constants_decode():
    nodes = [
        {
            "op": "aten::full.default",
            "args": [[2], {"$float": "inf"}],
            "kwargs": {
                "dtype": {"$dtype": "float32"},
                "device": {"$device": "remote_accelerator:0"},
                "layout": {"$layout": "strided"},
            },
        },
        {"op": "aten::mul.Scalar", "args": [{"$v": 0}, {"$complex": [0, 0]}]},
    ]
    (_, fetch), _ = run(nodes, fetch=[{"$v": 0}])
    assert torch.isinf(fetch[0]).all()


@pytest.mark.parametrize(
    "name",
    [
        "builtins::eval",
        "aten::__class__",
        "os::system",
        "aten::add.__init__",
        "aten::add..x",
        "torch::add",
        "aten::no_such_op_xyz",
        "aten::add.NoSuchOverload",
        5,
        None,
    ],
)
def test_only_aten_and_prims_ops_resolve(name):
    with pytest.raises(UnsupportedOp):
        resolve_op(name)


def test_prims_ops_resolve():
    assert resolve_op("prims::add.default") is torch.ops.prims.add.default


@pytest.mark.parametrize(
    ("nodes", "error"),
    [
        ([{"op": "aten::neg.default", "args": [{"$v": 0}]}], InvalidArgument),  # self reference
        ([{"op": "aten::neg.default", "args": [{"$v": 5}]}], InvalidArgument),  # later node
        ([{"op": "aten::neg.default", "args": [{"$h": "zz"}]}], NotFound),
        ([{"op": "aten::neg.default", "args": [{"$evil": 1}]}], InvalidArgument),
        ([{"op": "aten::neg.default", "args": {"x": 1}}], InvalidArgument),
        (["aten::neg.default"], InvalidArgument),
        ([{"op": "aten::mm.default", "args": [{"$h": "a"}, {"$h": "b"}]}], ExecutionError),
    ],
)
def test_bad_graphs_raise_typed_errors(nodes, error):
    with pytest.raises(error):
        run(nodes)


def test_stack_limit_is_a_resource_error_not_a_crash():
    nodes = [{"op": "aten::zeros.default", "args": [[1024, 1024]]}]
    with pytest.raises(ResourceExhausted):
        run(nodes, fetch=[{"$v": 0}], stack_capacity=1 << 20)


def test_intermediates_are_released_after_last_use():
    # Four 4 MiB intermediates in a chain: the peak stays near two, not four.
    nodes = [{"op": "aten::zeros.default", "args": [[1 << 20]]}]
    for i in range(3):
        nodes.append({"op": "aten::add.Scalar", "args": [{"$v": i}, 1]})
    (_, fetch), stack = run(nodes, fetch=[{"$v": 3}])
    assert torch.equal(fetch[0], torch.full((1 << 20,), 3.0))
    assert stack.peak <= 2 * (4 << 20)


@pytest.mark.parametrize(
    "name",
    [
        "aten::from_file.default",
        "aten::_reshape_alias.default",
        "aten::_reshape_alias_copy.default",
        "aten::set_.source_Storage",
        "aten::_index_put_impl_.default",
        "aten::resize_.default",
        "aten::_unsafe_index.Tensor",
        "aten::_unsafe_masked_index.default",
    ],
)
def test_dangerous_aten_ops_are_refused(name):
    # files, unchecked views, storage rebinding and unchecked indexing: never for clients
    with pytest.raises(UnsupportedOp):
        resolve_op(name)


def test_views_outside_their_storage_are_caught_after_any_op():
    from djinn.appliance.executor import oppolicy

    t = torch.zeros(4)
    bad = torch.ops.aten._reshape_alias.default(t, [100], [1])
    with pytest.raises(ExecutionError):
        oppolicy.check_bounds(bad, "test")
    oppolicy.check_bounds((t[1:], t.t(), torch.zeros(0)), "test")  # fine views pass


def test_autograd_view_ops_named_unsafe_are_allowed():
    assert resolve_op("aten::_unsafe_view.default") is torch.ops.aten._unsafe_view.default


def test_a_templates_last_uses_are_worked_out_once(monkeypatch):
    from djinn.appliance.executor import graph

    monkeypatch.setattr(graph, "_LAST_USES", type(graph._LAST_USES)())
    found = []
    real = GraphRun._find_last_uses

    def counting(self):
        found.append(self.template)
        return real(self)

    monkeypatch.setattr(GraphRun, "_find_last_uses", counting)
    nodes = [
        {"op": "aten::add.Tensor", "args": [{"$h": "a"}, {"$h": "b"}]},
        {"op": "aten::mul.Tensor", "args": [{"$v": 0}, 2.0]},
        {"op": "aten::neg.default", "args": [{"$v": 1}]},
    ]
    results = []
    for template in ("fp", "fp", None):
        stack = DeviceVMU(1 << 30)["stack"]
        g = GraphRun({"nodes": nodes, "keep": [], "fetch": [{"$v": 2}]}, _lookup, [],
                     torch.device("cpu"), stack)  # fmt: skip
        g.template = template
        results.append(g.run()[1][0])
        assert stack.used == 0  # intermediates released as the plan says, every time
    assert found == ["fp", None]
    assert all(torch.equal(r, -(HANDLES["a"] + HANDLES["b"]) * 2) for r in results)


def _nested(x, levels):
    for _ in range(levels):
        x = [x]
    return x


def test_arguments_nested_too_deeply_refuse_the_request_before_any_op_runs():
    """The walk for last uses refuses arguments nested past MAX_DEPTH, naming the node,
    before node 0 runs: in a partial graph too, whose node 0 would fail as its own."""
    from djinn.protocol.graph import MAX_DEPTH

    missing = {"op": "aten::neg.default", "args": [{"$h": "missing"}]}  # NOT_FOUND, partial
    for deep in (_nested({"$v": 0}, MAX_DEPTH + 1), _nested(1, MAX_DEPTH + 1)):
        stack = DeviceVMU(1 << 30)["stack"]
        nodes = [missing, {"op": "aten::neg.default", "args": deep}]
        g = GraphRun({"nodes": nodes, "fetch": [], "partial": True}, _lookup, [],
                     torch.device("cpu"), stack)  # fmt: skip
        with pytest.raises(InvalidArgument, match="node 1: arguments nested too deeply"):
            g.run()
        assert g.failed is None and stack.used == 0
    g = GraphRun({"nodes": [missing, {"op": "aten::neg.default", "args": []}]}, _lookup, [],
                 torch.device("cpu"), DeviceVMU(1 << 30)["stack"])  # fmt: skip
    g.nodes[1]["args"] = _nested({"$v": 0}, MAX_DEPTH)  # the deepest a reference may be
    g.nodes[1]["kwargs"] = {"k": _nested({"$v": 0}, MAX_DEPTH - 1)}
    assert g._find_last_uses() == {1: [0]}


def test_what_the_rest_reads_is_found_beside_nesting_the_request_was_let_through_with():
    """Note [walking value references]: the walk for the values the rest of a failed graph
    reads looks no deeper than MAX_DEPTH where it cannot use what it would find, rather
    than failing: a node nested as deep as the request may be still names its other
    references."""
    from djinn.protocol.graph import MAX_DEPTH

    nodes = [
        {"op": "aten::neg.default", "args": [{"$h": "a"}]},
        {"op": "aten::neg.default", "args": [{"$h": "missing"}]},  # fails: the rest is node 2
        {"op": "aten::add.Tensor", "args": [{"$v": 0}, _nested({"$v": 0}, MAX_DEPTH - 1)]},
    ]
    g = GraphRun({"nodes": nodes, "fetch": [], "partial": True}, _lookup, [],
                 torch.device("cpu"), DeviceVMU(1 << 30)["stack"])  # fmt: skip
    g.run()
    assert g.failed[0] == 1
    held = g.held_for_rest()
    assert [ref for ref, _ in held] == [{"$v": 0}]
    assert torch.equal(held[0][1], -HANDLES["a"])
