"""Note [unchanged puts]: which handles the journal's requests may have written into.
A handle missing from ``written_anywhere`` is kept by a lineage cut as the bytes it was
put with, so a write this misses would make a recovery restore a stale value."""

from __future__ import annotations

from djinn.runtime.journal import Entry, written_anywhere


def _exec(nodes, keep=(), out=()):
    return Entry("exec", {"nodes": nodes, "keep": list(keep), "fetch": []}, out=list(out))


def h(x):
    return {"$h": x}


def v(i, k=None):
    return {"$v": i} if k is None else {"$v": i, "i": k}


def test_reads_write_nothing():
    e = _exec([{"op": "aten::add.Tensor", "args": [h("W"), h("X")]}])
    assert written_anywhere([e]) == set()


def test_in_place_and_out_variants_write_their_target():
    e = _exec(
        [
            {"op": "aten::add_.Tensor", "args": [h("W"), h("X")]},
            {"op": "aten::arange.start_out", "args": [0, 4], "kwargs": {"out": h("O")}},
        ]
    )
    assert written_anywhere([e]) == {"W", "O"}


def test_a_write_through_a_view_in_the_graph_writes_the_base():
    e = _exec(
        [
            {"op": "aten::t.default", "args": [h("W")]},
            {"op": "aten::select.int", "args": [v(0), 0, 1]},
            {"op": "aten::fill_.Scalar", "args": [v(1), 0.0]},
            {"op": "aten::mul.Tensor", "args": [h("X"), h("Y")]},  # fresh: aliases nothing
            {"op": "aten::fill_.Scalar", "args": [v(3), 1.0]},
        ]
    )
    assert written_anywhere([e]) == {"W"}


def test_a_view_kept_as_a_handle_and_written_later_writes_its_base():
    make = _exec(
        [{"op": "aten::view.default", "args": [h("W"), [4]]}],
        keep=[v(0)],
        out=["V"],
    )
    view_of_view = _exec(
        [{"op": "aten::slice.Tensor", "args": [h("V"), 0, 0, 2]}],
        keep=[v(0)],
        out=["V2"],
    )
    write = _exec([{"op": "aten::mul_.Scalar", "args": [h("V2"), 2.0]}])
    assert written_anywhere([make, view_of_view, write]) == {"V2", "V", "W"}
    assert written_anywhere([make, view_of_view]) == set()


def test_fresh_outputs_kept_do_not_tie_their_inputs():
    make = _exec([{"op": "aten::mul.Tensor", "args": [h("W"), 2]}], keep=[v(0)], out=["Y"])
    write = _exec([{"op": "aten::add_.Tensor", "args": [h("Y"), 1]}])
    assert written_anywhere([make, write]) == {"Y"}


def test_model_calls_and_unknown_ops_count_as_writing_what_they_name():
    call = Entry("call", {"fingerprint": "f", "args": [h("A")]}, out={"$h": "B"})
    odd = _exec([{"op": "no_such::op.default", "args": [h("C"), v(0)]}])
    assert written_anywhere([call, odd]) == {"A", "B", "C"}
