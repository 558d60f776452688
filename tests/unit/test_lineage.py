"""The lineage journal's pure parts (Note [lineage journal], [lineage pruning],
[lineage truncation] in djinn/runtime/lineage.py): renaming, pairing replies, what a
replay may skip, and which views a cut makes again from their bases."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from djinn.errors import RecoveryFailed
from djinn.runtime.lineage import (
    Entry,
    _remade_views,
    needed,
    pair_ids,
    remap,
    view_outputs,
    written_handles,
)


def _exec(nodes: list[dict], kept: list[str | None]) -> Entry:
    keep = [{"$v": i} for i in range(len(kept))]
    return Entry("exec", {"nodes": nodes, "keep": keep, "fetch": []}, [], kept)


def test_remap_renames_handles_anywhere_and_leaves_other_strings():
    body = {"nodes": [{"op": "aten::add.Tensor", "args": [{"$h": "a"}, {"$h": "b"}]}]}
    body["state"] = {"w": "a"}
    out = remap(body, {"a": "A"})
    assert out["nodes"][0]["args"] == [{"$h": "A"}, {"$h": "b"}]
    assert out["state"] == {"w": "A"} and out["nodes"][0]["op"] == "aten::add.Tensor"


def test_pair_ids_maps_handles_and_objects_of_a_replayed_reply():
    old = {"$mo": "x", "fields": {"logits": {"$h": "h1"}, "past": {"$o": "o1"}}}
    new = {"$mo": "x", "fields": {"logits": {"$h": "H1"}, "past": {"$o": "O1"}}}
    mapping: dict[str, str] = {}
    pair_ids(old, new, mapping)
    assert mapping == {"h1": "H1", "o1": "O1"}
    with pytest.raises(RecoveryFailed):
        pair_ids(old, {"$mo": "x", "fields": {"logits": [1, 2]}}, {})


def test_views_and_writes_come_from_the_op_schema():
    assert view_outputs("aten::t.default") == (True,)
    assert view_outputs("aten::mm.default") == (False,)
    node = {"op": "aten::add_.Tensor", "args": [{"$h": "p"}, {"$h": "g"}]}
    assert written_handles(node) == {"p"}
    foreach = {"op": "aten::_foreach_add_.List", "args": [[{"$h": "p"}, {"$h": "q"}], []]}
    assert written_handles(foreach) == {"p", "q"}


def test_a_replay_skips_what_no_live_value_depends_on():
    entries = [
        Entry("put", None, [None], ["x"]),
        _exec([{"op": "aten::mul.Tensor", "args": [{"$h": "x"}, 2]}], ["dead"]),
        _exec([{"op": "aten::add.Tensor", "args": [{"$h": "x"}, 1]}], ["y"]),
        _exec([{"op": "aten::add_.Tensor", "args": [{"$h": "x"}, 1]}], [None]),  # writes x
        Entry("free", ["dead"]),
    ]
    assert needed(entries, {"y"}) == [True, False, True, False, True]
    assert needed(entries, {"x"}) == [True, False, False, True, True]


def test_a_finished_decode_sequence_is_not_replayed_but_the_live_one_is():
    def call(ids: list[str], oid: str, out: str) -> Entry:
        body = {"args": [{"$h": i} for i in ids], "kwargs": {"past_key_values": {"$o": oid}}}
        return Entry("call", body, [], {"logits": {"$h": out}, "past": {"$o": oid}})

    entries = [call(["t0"], "c1", "l1"), call(["t1"], "c1", "l2"), call(["t2"], "c2", "l3")]
    assert needed(entries, {"c2", "l3"}) == [False, False, True]
    assert needed(entries, {"c1"}) == [True, True, False]


def test_views_keep_their_base_needed():
    entries = [
        _exec([{"op": "aten::t.default", "args": [{"$h": "w"}]}], ["wt"]),
        _exec([{"op": "aten::mul_.Tensor", "args": [{"$h": "wt"}, 2]}], [None]),
    ]
    # w is live; the write went through its view: both are needed
    assert needed(entries, {"w"}) == [True, True]


def _remote(view: object) -> SimpleNamespace:
    return SimpleNamespace(view=view)


def test_a_cut_makes_views_again_from_their_bases_or_waits():
    t = {"op": "aten::t.default", "args": [{"$h": "w"}]}
    tt = {"op": "aten::t.default", "args": [{"$h": "wt"}]}
    live = {"w": _remote(False), "wt": _remote((t, 0)), "wtt": _remote((tt, 0))}
    assert list(_remade_views(live)) == ["wt", "wtt"]  # bases first
    assert _remade_views({"wt": _remote((t, 0))}) is None  # its base is not held
    assert _remade_views({"w": _remote(False), "v": _remote(True)}) is None
