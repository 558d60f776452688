"""Views taken before a write into their base failed (Note [a failed write's views],
djinn/frontend/failures.py).

A view has a handle of its own on its base's bytes. A failed write into the base poisoned
the base, but a view taken before it read the bytes from before the write, and every
later write into the base was lost in it too, with no error anywhere (a fuzz of views and
writes: ``torch.add(a.t(), 1.5, out=a)``, then ``a.data.add_(1)``). Eager refuses such a
write at the call; Djinn learns of it when the graph runs, so every tensor sharing the
written bytes now raises its error when read, as the base does, and so does any op
captured after the write that reads one of them.
"""

from __future__ import annotations

import pytest
import torch

from djinn.errors import DjinnError

R = "remote_accelerator:0"

FAILED_WRITES = {  # name: (a write into ``a`` (4, 4) that eager refuses at the call, words)
    "overlapping out=": (
        lambda a: torch.add(a.t(), 1.5, out=a),
        "refer to a single memory location",
    ),
    "index out of range": (
        lambda a: a.index_add_(0, torch.tensor([9]).to(R), torch.ones(1, 4).to(R)),
        "index 9 is out of bounds",
    ),
}
VIEWS = {
    "transposed": lambda a: a.t(),
    "row": lambda a: a[1],
    "flattened": lambda a: a.view(-1),
}
AFTERWARDS = {  # what the program does next, in the same graph as the failed write
    "nothing": lambda a, v: v,
    "an op reading the view": lambda a, v: v * 2,
    "a later write into the base": lambda a, v: (a.data.add_(1), v + 0)[1],
    "a write into the view": lambda a, v: (v.mul_(3), v + 0)[1],
}


@pytest.mark.parametrize("after", list(AFTERWARDS))
@pytest.mark.parametrize("view", list(VIEWS))
@pytest.mark.parametrize("write", list(FAILED_WRITES))
def test_a_view_taken_before_a_failed_write_raises_its_error(remote, write, view, after):
    fail, words = FAILED_WRITES[write]
    a = torch.arange(16.0).reshape(4, 4).to(R)
    v = VIEWS[view](a)
    fail(a)
    out = AFTERWARDS[after](a, v)
    other = torch.ones(2).to(R) * 3  # captured beside it: computes
    with pytest.raises(DjinnError, match=words):
        out.cpu()
    with pytest.raises(DjinnError, match=words):
        v.cpu()
    with pytest.raises(DjinnError, match=words):
        a.cpu()
    with pytest.raises(DjinnError, match=words):
        (v.sum() + 1).cpu()  # captured after the failure landed
    assert other.cpu().tolist() == [3.0, 3.0]


def test_a_view_read_once_the_failure_landed_raises_it(remote):
    """The failure landed with another value's read; the view is read after."""
    a = torch.arange(16.0).reshape(4, 4).to(R)
    v = a.t()
    v.cpu()  # v has a handle of its own now
    fail, words = FAILED_WRITES["index out of range"]
    fail(a)
    other = torch.ones(2).to(R) * 3
    assert other.cpu().tolist() == [3.0, 3.0]  # lands the graph: the write fails there
    with pytest.raises(DjinnError, match=words):
        v.cpu()


def test_views_of_other_tensors_and_work_before_the_write_keep_their_values(remote):
    """Only the written bytes hold the error: a value computed from the view before the
    write, and a view of another tensor, read as in eager."""
    a = torch.arange(16.0).reshape(4, 4).to(R)
    b = torch.arange(16.0).reshape(4, 4).to(R)
    v, w = a.t(), b.t()
    before = v * 2
    fail, _ = FAILED_WRITES["overlapping out="]
    fail(a)
    b.add_(1)
    want = torch.arange(16.0).reshape(4, 4)
    assert torch.equal(before.cpu(), want.t() * 2)
    assert torch.equal(w.cpu(), (want + 1).t())
