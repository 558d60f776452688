"""Note [journal facts of a template]: what the journal works out of a replayed graph,
worked out once on its template and renamed to each call's handles, is what it works out
of the call's whole body; and ``templates.instantiator`` makes the bodies
``templates.instantiate`` makes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from djinn.protocol import templates
from djinn.runtime.journal import (
    Entry,
    GraphFacts,
    apply_views,
    distinct_handles,
    entry_writes,
    view_kinds,
)


def h(x):
    return {"$h": x}


def v(i, k=None):
    return {"$v": i} if k is None else {"$v": i, "i": k}


# an optimizer-like step: writes a weight in place, and another through a view of it;
# keeps a view of a weight (made again from handles), two views of one intermediate (not
# private: they share it), a view of an intermediate it keeps nowhere else (private), and
# a plain result
NODES = [
    {"op": "aten::add_.Tensor", "args": [h("W"), h("G")], "kwargs": {"alpha": -0.1}},
    {"op": "aten::t.default", "args": [h("B")]},
    {"op": "aten::mul_.Scalar", "args": [v(1), 0.9]},
    {"op": "aten::t.default", "args": [h("W")]},
    {"op": "aten::mm.default", "args": [h("G"), h("G")]},
    {"op": "aten::t.default", "args": [v(4)]},
    {"op": "aten::mm.default", "args": [h("B"), h("B")]},
    {"op": "aten::t.default", "args": [v(6)]},
    {"op": "aten::sum.default", "args": [h("G")]},
    {"op": "aten::view.default", "args": [v(4), [16]]},
]
KEEP = [v(3), v(5), v(7), v(8), v(9)]


def body(names: dict[str, str]) -> dict:
    """The step's graph with its handles named ``names``."""
    return templates.instantiate(templates.template({"nodes": NODES, "keep": KEEP})[0],
                                 [names[k] for k in ("W", "G", "B")], [-0.1, 0.9])  # fmt: skip


def test_a_templates_facts_renamed_are_the_facts_of_each_call():
    first = {"W": "w1", "G": "g1", "B": "b1"}
    kept1 = ["k10", "k11", "k12", "k13", "k14"]
    facts = GraphFacts(body(first), ["w1", "g1", "b1"], kept1, [-0.1, 0.9])
    for names, kept in (
        ({"W": "w2", "G": "g2", "B": "b2"}, ["k20", "k21", "k22", "k23", "k24"]),
        ({"W": "g1", "G": "w1", "B": "x"}, ["k30", "k31", "k32", "k33", "k34"]),
    ):
        inputs = [names[k] for k in ("W", "G", "B")]
        assert facts.fits(inputs, kept, [-0.1, 0.9])
        writes, kinds = facts.of(inputs, kept)
        whole = body(names)
        assert writes == entry_writes(Entry("exec", whole, out=kept))
        assert kinds == view_kinds(whole, kept)
    # what the graph does, by the last call's names (W is "g1", B is "x")
    written, bases = writes
    assert written == {"g1", "x"}
    assert kinds == [({"op": "aten::t.default", "args": [h("g1")]}, v(0)), "view", "private",
                     None, "view"]  # fmt: skip
    assert bases["k30"] == {"g1"}


def test_facts_are_used_only_where_every_handle_is_another():
    facts = GraphFacts(body({"W": "w", "G": "g", "B": "b"}), ["w", "g", "b"], ["k"] * 5, [0.5])
    assert not facts.fits(["w", "g"], ["k"] * 5, [0.5])  # another template's arity
    assert not facts.fits(["w", "g", "b"], ["k1", None, "k3", "k4", "k5"], [0.5])  # a node failed
    assert not distinct_handles(["w", "w", "b"], ["k1", "k2", "k3", "k4", "k5"])  # one handle twice
    assert not distinct_handles(["w", "g", "b"], ["w", "k2", "k3", "k4", "k5"])  # kept is an input
    assert distinct_handles(["w", "g", "b"], ["k1", "k2", "k3", "k4", "k5"])


def test_applied_kinds_mark_kept_tensors_as_the_whole_body_would():
    dense = SimpleNamespace(view=None, shape=[4, 4], strides=[4, 1])
    strided = SimpleNamespace(view=None, shape=[4, 4], strides=[8, 1])  # a slice: gaps
    kept = [SimpleNamespace(view=None), dense, strided, None]
    apply_views([({"op": "aten::t.default", "args": [h("w")]}, v(0)), "private", "private",
                 "view"], kept)  # fmt: skip
    assert kept[0].view == ({"op": "aten::t.default", "args": [h("w")]}, v(0))
    assert dense.view is False  # private and dense: read back, it is the same tensor
    assert strided.view is True


def test_an_instantiator_makes_what_instantiate_makes():
    tpl, inputs, scalars = templates.template({"nodes": NODES, "keep": KEEP, "fetch": [v(8)]})
    make = templates.instantiator(tpl)
    for ins, sc in ((inputs, scalars), (["a", "b", "c"], [1.5, -2.0])):
        assert make(ins, sc) == templates.instantiate(tpl, ins, sc)
    one, two = make(["a", "b", "c"], [1.0, 2.0]), make(["d", "e", "f"], [3.0, 4.0])
    assert one["nodes"][5] is two["nodes"][5] is tpl["nodes"][5]  # no slot: shared
    assert one["nodes"][0] is not two["nodes"][0]  # a node with a slot: its own copy
    assert one["nodes"][0]["args"][0] == h("a") and two["nodes"][0]["args"][0] == h("d")


def test_an_instantiator_copies_only_the_way_to_each_slot():
    """Random nested graphs: each body equals ``instantiate``'s, the template is left as
    it was, an argument list without a slot is shared, and a slot past the inputs or
    scalars sent is refused as ``instantiate`` refuses it."""
    import copy
    import random

    from djinn.errors import InvalidArgument

    rng = random.Random(7)

    def value(depth: int) -> object:
        roll = rng.random()
        if depth > 3 or roll < 0.3:
            return rng.choice([h(f"w{rng.randrange(6)}"), 0.5 * rng.randrange(9), 3, "s", None])
        if roll < 0.65:
            return [value(depth + 1) for _ in range(rng.randrange(4))]
        return {f"k{i}": value(depth + 1) for i in range(rng.randrange(3))}

    for _ in range(200):
        nodes = [{"op": "aten::x.default", "args": [value(0) for _ in range(3)],
                  "kwargs": {"alpha": value(1)}} for _ in range(rng.randrange(1, 5))]  # fmt: skip
        tpl, inputs, scalars = templates.template({"nodes": nodes, "keep": KEEP, "fetch": []})
        before = copy.deepcopy(tpl)
        make = templates.instantiator(tpl)
        ins, sc = [f"n{i}" for i in range(len(inputs))], [float(i) for i in range(len(scalars))]
        assert make(ins, sc) == templates.instantiate(tpl, ins, sc)
        assert make(inputs, scalars) == templates.instantiate(tpl, inputs, scalars)
        assert tpl == before
        if inputs:
            with pytest.raises(InvalidArgument, match="input"):
                make(ins[:-1], sc)
        if scalars:
            with pytest.raises(InvalidArgument, match="scalar"):
                make(ins, sc[:-1])
    tpl, _, _ = templates.template(
        {"nodes": [{"op": "aten::y.default", "args": [[1, 2], h("a"), [3, 4.0]]}]}
    )
    body = templates.instantiator(tpl)(["b"], [5.0])
    assert body["nodes"][0]["args"] == [[1, 2], h("b"), [3, 5.0]]
    assert body["nodes"][0]["args"][0] is tpl["nodes"][0]["args"][0]  # no slot: shared


def test_only_handles_are_renamed_not_strings_that_spell_a_placeholder():
    from djinn.runtime.journal import _renamed

    node = {"op": "aten::t.default", "args": [h("@0"), "@0"], "kwargs": {"x": {"$h": "@k1"}}}
    assert _renamed(node, {"@0": "w", "@k1": "k"}) == {
        "op": "aten::t.default", "args": [h("w"), "@0"], "kwargs": {"x": h("k")}}  # fmt: skip


def test_a_view_made_again_with_a_float_is_a_fact_of_that_float_only(monkeypatch):
    """A view made again by running its op holds the call's floats, which the template
    leaves out (found by review: the first call's were used for every later call of the
    template). No aten view takes a float; an op of another library might, so one is
    made up here: a view that writes nothing."""
    from djinn.runtime import journal

    monkeypatch.setattr(journal, "written_outputs", lambda op: frozenset())

    def graph(w: str, scale: float) -> dict:
        nodes = [{"op": "myns::scaled_view.default", "args": [h(w), scale]}]
        return {"nodes": nodes, "keep": [v(0)], "fetch": []}

    facts = GraphFacts(graph("w1", 0.5), ["w1"], ["k1"], [0.5])
    assert facts.fits(["w2"], ["k2"], [0.5])
    assert facts.of(["w2"], ["k2"])[1] == view_kinds(graph("w2", 0.5), ["k2"])
    assert not facts.fits(["w2"], ["k2"], [0.25])  # walked instead: its own float
    # no float in what is made again: any floats fit (Adam's step keeps no view)
    plain = GraphFacts(body({"W": "w", "G": "g", "B": "b"}), ["w", "g", "b"], ["k"] * 5, [1.0])
    assert plain.fits(["w", "g", "b"], ["k1", "k2", "k3", "k4", "k5"], [-0.3, 0.7])


def test_an_output_that_is_an_argument_the_op_writes_is_not_made_again_by_it():
    """``w.add_(g)`` kept as its own handle: running ``add_`` again on the bases a cut put
    back would add ``g`` twice (found by review, through ``Session.execute``)."""
    nodes = [
        {"op": "aten::add_.Tensor", "args": [h("w"), h("g")], "kwargs": {"alpha": -0.1}},
        {"op": "aten::add.out", "args": [h("w"), h("g")], "kwargs": {"out": h("o")}},
        {"op": "aten::t.default", "args": [h("w")]},
    ]
    kinds = view_kinds({"nodes": nodes, "keep": [v(0), v(1), v(2)]}, ["k0", "k1", "k2"])
    assert kinds[0] == "view" and kinds[1] == "view"  # a cut waits for them
    assert kinds[2] == ({"op": "aten::t.default", "args": [h("w")]}, v(0))
