"""Note [private views]: a kept view of storage its own graph made, shared with nothing
else the session holds, does not stop a lineage cut; and a cut that must wait tries
again soon (Note [lineage truncation])."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import torch

from djinn.runtime.journal import Entry, mark_views, private_views
from djinn.runtime.lineage import Lineage, Policy


def h(x):
    return {"$h": x}


def v(i, k=None):
    return {"$v": i} if k is None else {"$v": i, "i": k}


def _body(nodes, keep):
    return {"nodes": nodes, "keep": keep, "fetch": []}


# a weight's gradient as autograd's backward graph keeps it: the transpose of a product
GRAD = [
    {"op": "aten::mm.default", "args": [h("G"), h("X")]},
    {"op": "aten::t.default", "args": [v(0)]},
    {"op": "aten::sum.dim_IntList", "args": [h("G"), [0], True]},
    {"op": "aten::view.default", "args": [v(2), [4]]},
]


def test_views_of_intermediates_kept_alone_are_private():
    assert private_views(_body(GRAD, [v(1), v(3)]), ["gw", "gb"]) == {0, 1}


def test_a_view_kept_beside_its_base_or_another_view_of_it_is_not():
    assert private_views(_body(GRAD, [v(0), v(1)]), ["m", "gw"]) == set()
    two = [*GRAD, {"op": "aten::view.default", "args": [v(0), [-1]]}]
    assert private_views(_body(two, [v(1), v(4), v(3)]), ["a", "b", "gb"]) == {2}
    # a base the graph did not keep (None: a partial graph's failed node) shares nothing
    assert private_views(_body(GRAD, [v(0), v(1)]), [None, "gw"]) == {1}


def test_views_of_handles_inline_tensors_or_in_place_writes_are_not():
    nodes = [
        {"op": "aten::add_.Tensor", "args": [h("W"), 1.0]},  # returns W itself
        {"op": "aten::view.default", "args": [v(0), [-1]]},
        {"op": "aten::view.default", "args": [{"$t": 0, "desc": {}}, [-1]]},
        {"op": "aten::mul.Tensor", "args": [h("W"), 2.0]},
        {"op": "aten::unbind.int", "args": [v(3)]},  # views of a fresh product: private
    ]
    body = _body(nodes, [v(1), v(2), v(4, 0), v(0)])
    assert private_views(body, ["a", "b", "c", "d"]) == {2}


def _remote(shape, strides, handle="r"):
    return SimpleNamespace(
        view=False, shape=torch.Size(shape), strides=tuple(strides), handle=handle
    )


def test_mark_views_leaves_private_dense_views_as_owners():
    gw, gb, wt = _remote([3, 4], [1, 3]), _remote([4], [1]), _remote([4, 2], [1, 4])
    body = _body([*GRAD, {"op": "aten::t.default", "args": [h("W")]}], [v(1), v(3), v(4)])
    mark_views(body, [gw, gb, wt])
    assert gw.view is False and gb.view is False  # read back and put again: the same
    assert wt.view == ({"op": "aten::t.default", "args": [h("W")]}, {"$v": 0})
    # a private view whose layout the wire cannot carry (a strided slice) still waits
    sliced = _remote([2], [2])
    nodes = [{"op": "aten::mul.Tensor", "args": [h("X"), 2.0]}]
    nodes.append({"op": "aten::slice.Tensor", "args": [v(0), 0, 0, 4, 2]})
    mark_views(_body(nodes, [v(1)]), [sliced])
    assert sliced.view is True


def test_a_view_of_an_output_kept_beside_it_is_made_again_from_its_handle():
    # the first step of a training loop uploads a weight and keeps its transpose
    nodes = [{"op": "aten::clone.default", "args": [{"$t": 0, "desc": {}}]}]
    nodes.append({"op": "aten::t.default", "args": [v(0)]})
    w, wt = _remote([4, 2], [2, 1], "W"), _remote([2, 4], [1, 2], "WT")
    mark_views(_body(nodes, [v(0), v(1)]), [w, wt])
    assert w.view is False
    assert wt.view == ({"op": "aten::t.default", "args": [h("W")]}, {"$v": 0})


class _Session:
    """What a cut reads of its session: objects held (a KV cache) and pending frees."""

    def __init__(self, objects: dict) -> None:
        self._remote_objects = objects
        self._lists_lock = threading.Lock()
        self._pending_free: list[str] = []

    def _settle(self) -> None:
        """No graph in flight here (Note [asynchronous flushes])."""


def test_a_cut_that_must_wait_tries_again_after_an_eighth_of_the_replay():
    lin = Lineage(_Session({"kv": object()}), Policy(checkpoint_seconds=1.0))  # type: ignore[arg-type]

    def request(seconds: float) -> None:
        lin.record(Entry("free", ["x"], nbytes=32, seconds=seconds))

    request(1.0)
    assert lin.cut_due
    assert lin.checkpoint() is False  # a KV cache is held: it cannot be read back
    lin.cut_due = False
    request(0.1)
    assert not lin.cut_due  # 1.1 s recorded, the next try at 1.125 s, not 2.0 s
    request(0.03)
    assert lin.cut_due
    assert lin.stats()["checkpoints_put_off"] == 1


def test_a_request_whose_cut_rebuilt_the_session_goes_with_the_new_handles():
    """The cut settles the graph in flight first; if that graph's worker was lost, the
    session is rebuilt there, and the request waiting behind the cut, built with the old
    handles, must be sent with the new ones (a review's finding)."""

    class Rebuilt(_Session):
        def _settle(self) -> None:  # the graph in flight: its worker lost, the session rebuilt
            lin.maps[lin.generation] = {"old": "new"}
            lin.generation += 1

    lin = Lineage(Rebuilt({}), Policy(checkpoint_seconds=1.0))  # type: ignore[arg-type]
    lin.cut_due = True
    sent = []
    lin.run_body(lambda body: sent.append(body), {"args": [{"$h": "old"}]})
    assert sent == [{"args": [{"$h": "new"}]}]
