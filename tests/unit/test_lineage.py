"""The lineage journal's pure parts (Note [lineage journal], [lineage pruning],
[lineage truncation] in djinn/runtime/lineage.py): renaming, pairing replies, what a
replay may skip, and which views a cut makes again from their bases."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from djinn.errors import RecoveryFailed
from djinn.protocol.tensors import to_wire
from djinn.runtime import kv_replay
from djinn.runtime.kv_replay import coalesce, ids_of
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


# -- Note [kv prefill replay]: a live cache's decode steps merged into prefills ----------
GPT2 = "transformers.models.gpt2.modeling_gpt2.GPT2LMHeadModel"  # takes logits_to_keep
V = 50


@pytest.fixture(autouse=True)
def _gpt2_takes_logits_to_keep(monkeypatch):
    """Without importing transformers: the registered class GPT2 takes logits_to_keep."""
    monkeypatch.setattr(kv_replay, "takes_logits_to_keep", lambda path: path == GPT2)


def _ids(values: list[int]) -> torch.Tensor:
    return torch.tensor([values])


def _logits(h: str, n: int) -> dict:
    return {"$h": h, "dtype": "float32", "shape": [1, n, V], "strides": [n * V, V, 1]}


def _out(logits: str, n: int, oid: str) -> dict:
    fields = {"logits": _logits(logits, n), "past_key_values": {"$o": oid, "class": "C"}}
    return {"$mo": "transformers.modeling_outputs.CausalLMOutputWithPast", "fields": fields}


def _prefill(values: list[int], oid: str, logits: str) -> Entry:
    desc, raw = to_wire(_ids(values))
    body = {
        "fingerprint": "fp",
        "method": "forward",
        "args": [{"$t": 0, "desc": desc}],
        "kwargs": {"use_cache": True},
    }
    return Entry("call", body, [bytes(raw.numpy())], _out(logits, len(values), oid))


def _step(token: str, value: int, oid: str, logits: str, **kwargs) -> Entry:
    body = {
        "fingerprint": "fp",
        "method": "forward",
        "args": [{"$h": token}],
        "kwargs": {"past_key_values": {"$o": oid}, "use_cache": True, **kwargs},
        "echo_ids": True,
    }
    return Entry("call", body, [], _out(logits, 1, oid), ids=_ids([value]))


def _argmax(logits: str, token: str) -> Entry:
    nodes = [
        {"op": "aten::select.int", "args": [{"$h": logits}, 1, -1]},
        {"op": "aten::argmax.default", "args": [{"$v": 0}, -1, True]},
    ]
    return Entry("exec", {"nodes": nodes, "keep": [{"$v": 1}], "fetch": []}, [], [token])


def _decode_journal(steps: int) -> list[Entry]:
    """The chaos loop's journal: a prompt, then per token the graph that picks it from
    the last logits and the step that feeds it back; what the program dropped, freed."""
    entries = [
        Entry("register", {"fingerprint": "fp", "class": GPT2}),
        _prefill([7, 8, 9], "C", "l0"),
    ]
    for k in range(steps):
        entries.append(_argmax(f"l{k}", f"t{k}"))
        entries.append(_step(f"t{k}", 100 + k, "C", f"l{k + 1}"))
        entries.append(Entry("free", [f"l{k}", *([f"t{k - 1}"] if k else [])]))
    return entries


def _calls(entries: list[Entry]) -> list[Entry]:
    return [e for e in entries if e.kind == "call"]


def _sent_ids(e: Entry) -> list[int]:
    ref = e.body["kwargs"].get("input_ids") or e.body["args"][0]
    return ids_of(e)[0].tolist() if "$t" in ref else []


def _holders(*handles: str) -> dict[str, SimpleNamespace]:
    """The program's RemoteTensors for tokens it holds: (1, 1) int64, no views."""
    meta = {"view": False, "dtype": torch.int64, "shape": (1, 1), "strides": (1, 1)}
    return {h: SimpleNamespace(**meta) for h in handles}


def _kinds(entries: list[Entry]) -> list[str]:
    return [e.kind for e in entries if e.kind != "free"]


def test_a_live_caches_decode_steps_become_one_prefill_that_returns_the_last_logits():
    entries = _decode_journal(5)  # the program holds the last logits, token and cache
    live = {"C", "l5", "t4"}
    out = coalesce(entries, live, _holders("t4"))
    (merged,) = _calls(out)
    assert merged.merged == 6
    assert _sent_ids(merged) == [7, 8, 9, 100, 101, 102, 103, 104]
    kwargs = merged.body["kwargs"]
    assert kwargs["logits_to_keep"] == 1 and "past_key_values" not in kwargs
    assert merged.out == entries[-2].out  # it pairs like the last step: l5 and the cache
    # no graph runs again: the tokens they picked are put back from their echoed values
    assert _kinds(out) == ["register", "call", "put", "put", "put", "put", "put"]
    assert out[-2].out == ["t4"] and out[-2].data[0][0].tolist() == [[104]]
    assert all(needed(out, live))


def test_a_held_token_that_cannot_be_put_back_is_picked_again_from_its_logits():
    entries = _decode_journal(5)
    out = coalesce(entries, {"C", "l5", "t4"})  # no holders: t4's layout is unknown
    merged, last = _calls(out)
    assert merged.merged == 5 and _sent_ids(merged) == [7, 8, 9, 100, 101, 102, 103]
    assert last is entries[-2]  # as recorded: it reads t4, picked again from l4
    assert [e.out for e in out if e.kind == "exec"] == [["t4"]]


def test_without_logits_to_keep_the_step_whose_logits_are_held_runs_alone(monkeypatch):
    monkeypatch.setattr(kv_replay, "takes_logits_to_keep", lambda path: False)
    entries = _decode_journal(5)
    out = coalesce(entries, {"C", "l5", "t4"}, _holders("t4"))
    merged, last = _calls(out)
    assert merged.merged == 5 and "logits_to_keep" not in merged.body["kwargs"]
    assert last.out == entries[-2].out and _sent_ids(last) == [104]
    assert "exec" not in _kinds(out)


def test_a_held_earlier_output_stops_the_merge_there():
    entries = _decode_journal(5)
    out = coalesce(entries, {"C", "l5", "l2"})  # the program keeps step 2's logits
    calls = _calls(out)
    assert calls[0].merged == 3 and _sent_ids(calls[0]) == [7, 8, 9, 100, 101]
    assert [c.merged for c in calls[1:]] == [1, 1, 1]
    assert [_sent_ids(c) for c in calls[1:]] == [[102], [103], [104]]  # ids inline
    # a buffer the program holds, written from step 1's logits: they come back
    copy = {"op": "aten::copy_.default", "args": [{"$h": "buf"}, {"$h": "l1"}]}
    entries.insert(entries.index(_calls(entries)[2]), _exec([copy], [None]))
    out = coalesce(entries, {"C", "l5", "buf"})
    assert _calls(out)[0].merged == 2 and _calls(out)[0].out == _calls(entries)[1].out
    assert [e.out for e in out if e.kind == "exec"] == [[None]]
    # written from a token whose value is known: the token is put back, all merged
    copy = {"op": "aten::copy_.default", "args": [{"$h": "buf"}, {"$h": "t1"}]}
    entries[entries.index(_calls(entries)[2]) - 1] = _exec([copy], [None])
    out = coalesce(entries, {"C", "l5", "buf"})
    assert _calls(out)[0].merged == 6
    assert _kinds(out)[:5] == ["register", "call", "put", "put", "exec"]


def test_steps_that_are_not_plain_forwards_replay_as_recorded():
    entries = _decode_journal(4)
    masked = _step("t3", 103, "C", "l4", attention_mask={"$h": "m"})
    entries[-2] = masked
    out = coalesce(entries, {"C", "l4", "m"})
    calls = _calls(out)
    # the masked step reads t3 by handle: t3's graph runs, from step 3's logits
    assert calls[0].merged == 4 and calls[-1] is masked
    assert [e.out for e in out if e.kind == "exec"] == [["t3"]]
    unknown = _decode_journal(4)
    unknown[-2].ids = None  # an appliance that did not echo the ids
    assert [c.merged for c in _calls(coalesce(unknown, {"C", "l4"}))] == [4, 1]
    out = coalesce(_decode_journal(4), {"l4"})  # no cache held: nothing to merge
    assert [c.merged for c in _calls(out)] == [1] * 5 and "exec" not in _kinds(out)


def test_a_held_token_of_a_finished_sequence_is_put_back_without_its_sequence():
    """The program dropped the sequence (its cache freed) but still holds its last token:
    the token comes back from its value; no call of the sequence is needed for it."""
    entries = [*_decode_journal(5), Entry("free_objects", ["C"])]
    out = coalesce(entries, {"t4"}, _holders("t4"))
    keep = needed(out, {"t4"})
    assert [e.kind for e, k in zip(out, keep, strict=True) if k and e.kind != "put"] == [
        "register",
        *["free"] * 5,
        "free_objects",
    ]
    assert [e.out for e in out if e.kind == "put"][-1] == ["t4"]
    # where it cannot be put back, the whole sequence replays to pick it again
    out = coalesce(entries, {"t4"})
    keep = needed(out, {"t4"})
    assert sum(k for e, k in zip(out, keep, strict=True) if e.kind == "call") == 6


def test_a_long_run_goes_as_several_prefills(monkeypatch):
    monkeypatch.setattr(kv_replay, "PREFILL_TOKENS", 5)
    out = coalesce(_decode_journal(6), {"C", "l6", "t5"}, _holders("t5"))
    calls = _calls(out)
    assert [_sent_ids(c) for c in calls] == [[7, 8, 9, 100, 101], [102, 103, 104, 105]]
    assert "past_key_values" not in calls[0].body["kwargs"]
    assert calls[1].body["kwargs"]["past_key_values"] == {"$o": "C"}
    assert [c.merged for c in calls] == [3, 4]


def test_a_recording_asks_for_its_ids_and_reads_the_echo():
    body = {"fingerprint": "fp", "args": [{"$h": "t"}], "kwargs": {}}
    assert kv_replay.ask_echo(body)["echo_ids"] is True
    inline = {"fingerprint": "fp", "args": [{"$t": 0, "desc": {}}], "kwargs": {}}
    assert "echo_ids" not in kv_replay.ask_echo(inline)
    ids = kv_replay.echoed({"ids": {"dtype": "int64", "values": [[5]]}})
    assert ids.dtype == torch.int64 and ids.tolist() == [[5]]
    column = {"dtype": "int32", "strides": [1, 2], "values": [[1, 2], [3, 4]]}
    ids = kv_replay.echoed({"ids": column})  # laid out as the handle was
    assert ids.stride() == (1, 2) and ids.tolist() == [[1, 2], [3, 4]]
    assert kv_replay.echoed({"ids": {**column, "strides": [5, 5]}}) is None
    assert kv_replay.echoed({"ids": {"dtype": "float32", "values": [[5.0]]}}) is None
    assert kv_replay.echoed({}) is None


def test_which_classes_take_logits_to_keep_is_read_from_the_programs_modules(monkeypatch):
    transformers = pytest.importorskip("transformers")
    monkeypatch.undo()
    forward = transformers.GPT2LMHeadModel.forward  # the program imported its model
    takes = "logits_to_keep" in __import__("inspect").signature(forward).parameters
    assert kv_replay.takes_logits_to_keep(GPT2) == takes
    assert not kv_replay.takes_logits_to_keep("transformers.no_such.Model")
    assert not kv_replay.takes_logits_to_keep("os.path.Thing")


def test_the_plain_kwargs_are_the_kv_recompute_ones():
    from djinn.appliance import recompute

    assert kv_replay.SAFE_KWARGS is recompute.SAFE_KWARGS  # one definition, djinn.protocol.kv
