"""Note [graph templates]: a graph's template takes out exactly its handles and floats."""

from __future__ import annotations

import pytest

from djinn.errors import InvalidArgument
from djinn.protocol.templates import fingerprint, instantiate, template


def _graph(h1: str, h2: str, alpha: float, dim: int = 1) -> dict:
    return {
        "nodes": [
            {
                "op": "aten::add.Tensor",
                "args": [{"$h": h1}, {"$h": h2}],
                "kwargs": {"alpha": alpha},
            },
            {"op": "aten::sum.dim_IntList", "args": [{"$v": 0}, [dim]]},
            {"op": "aten::mul.Tensor", "args": [{"$v": 1}, {"$h": h1}]},
        ],
        "keep": [{"$v": 0}],
        "fetch": [{"$v": 2}, {"$h": h2}],
    }


def test_template_round_trip():
    body = _graph("a", "b", 0.5)
    tpl, inputs, scalars = template(body)
    assert inputs == ["a", "b"] and scalars == [0.5]
    assert instantiate(tpl, inputs, scalars) == body


def test_same_structure_same_fingerprint_other_structure_another():
    fp = fingerprint(template(_graph("a", "b", 0.5))[0])
    assert fingerprint(template(_graph("x", "y", 2.0))[0]) == fp  # other tensors, scalars
    assert fingerprint(template(_graph("a", "a", 0.5))[0]) != fp  # one tensor twice
    assert fingerprint(template(_graph("a", "b", 0.5, dim=0))[0]) != fp  # another dim


def test_an_integer_past_64_bits_is_fingerprinted_too():
    """orjson refuses it; the fingerprint falls back to json, and still tells them apart."""
    big, bigger = _graph("a", "b", 0.5, dim=2**70), _graph("a", "b", 0.5, dim=2**70 + 1)
    fp = fingerprint(template(big)[0])
    assert fp == fingerprint(template(_graph("x", "y", 1.0, dim=2**70))[0])
    assert fp != fingerprint(template(bigger)[0])


def test_the_fingerprint_is_the_hash_of_the_templates_sorted_compact_json():
    """Pinned: clients and appliances of other versions compute the same fingerprint for
    the same template (the text json.dumps wrote before orjson did, for ASCII)."""
    import hashlib
    import json

    tpl = template(_graph("a", "b", 0.5))[0]
    text = json.dumps(tpl, sort_keys=True, separators=(",", ":"), allow_nan=False)
    assert fingerprint(tpl) == hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def test_key_order_does_not_change_the_fingerprint():
    body = _graph("a", "b", 0.5)
    shuffled = {**body, "nodes": [dict(reversed(list(n.items()))) for n in body["nodes"]]}
    assert fingerprint(template(shuffled)[0]) == fingerprint(template(body)[0])


@pytest.mark.parametrize(
    ("inputs", "scalars"),
    [(["a"], [0.5]), (["a", "b"], []), (["a", 3], [0.5]), (["a", "b"], [1]), ("ab", [0.5])],
)
def test_values_that_do_not_fit_the_template_are_refused(inputs, scalars):
    tpl, _, _ = template(_graph("a", "b", 0.5))
    with pytest.raises(InvalidArgument):
        instantiate(tpl, inputs, scalars)


@pytest.mark.parametrize("tag", ["$in", "$s"])
def test_a_graph_cannot_hold_a_templates_own_tags(tag):
    body = _graph("a", "b", 0.5)
    body["nodes"][0]["args"][1] = {tag: 0}
    with pytest.raises(InvalidArgument):
        template(body)


def test_which_graphs_go_by_template_counts_the_lists_nodes_take():
    from djinn.runtime.graph_forms import TEMPLATE_MIN_WEIGHT, worth_a_template

    handles = [{"$h": f"h{i}"} for i in range(24)]
    step = [{"op": "aten::_foreach_sqrt.default", "args": [handles]} for _ in range(2)]
    assert worth_a_template(step)  # 2 nodes over 24 tensors
    assert not worth_a_template([{"op": "aten::add.Tensor", "args": [{"$h": "a"}, 1]}] * 3)
    assert worth_a_template([{"op": "aten::neg.default", "args": []}] * TEMPLATE_MIN_WEIGHT)
    # what a caller of Session.execute may send is the appliance's to refuse, not a crash
    odd = [{"op": "aten::ones.default", "kwargs": {"size": [2]}}, {"args": None}, "x", 3]
    assert not worth_a_template(odd) and not worth_a_template(None)
