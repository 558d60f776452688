"""Note [a returned view's base] (djinn/frontend/replay_sources.py): a replayed call may
return views of what it made; one that keeps such a tensor elsewhere runs as it is."""

from __future__ import annotations

import gc

import pytest
import torch

import djinn
from tests.integration.test_replayable import _mlp, _moved


@pytest.mark.parametrize(
    "view",
    [
        lambda y: y.view(-1),
        lambda y: y[:, -1],
        lambda y: y.transpose(0, 1),
        lambda y: y.unsqueeze(0)[..., :2],  # a view of a view: both of the same base
    ],
    ids=["view", "select", "transpose", "view-of-view"],
)
@pytest.mark.parametrize("collected", [False, True], ids=["young", "collected"])
def test_a_call_returning_a_view_of_what_it_made_replays(remote, view, collected):
    """Note [a returned view's base]: the base of a returned view (GPT-2's last hidden
    state is a ``view`` of its final layer norm's output) stays alive through the view
    alone; such a call used to run as it is every time ("it keeps a tensor it made")."""
    local = _mlp()
    model = _moved(local, remote)

    def fn(x):
        y = model(x)
        if collected:  # what the call made is in the oldest generation then, not the young
            gc.collect()
        return view(y)

    fwd = djinn.replayable(fn)
    with torch.no_grad():
        for _ in range(5):
            x = torch.randn(4, 16)
            out = fwd(x.to(remote))
            assert torch.equal(out.cpu(), view(local(x)))
            out.mul_(2)  # written where the view points, as a local one would be
            assert torch.equal(out.cpu(), view(local(x)) * 2)
    assert fwd.stats()["replays"] == 3 and fwd.stats()["plain"] == {}, fwd.stats()


@pytest.mark.parametrize(
    "keep",
    [
        lambda y, kept: kept.__setitem__("y", y),
        lambda y, kept: kept.__setitem__("y", y[1:]),  # another view of the same base
        lambda y, kept: kept.__setitem__("y", y.detach()),
        lambda y, kept: setattr(kept["module"], "cache", y.view(-1)),
    ],
    ids=["the base", "another view", "a detached alias", "a view on a module"],
)
def test_a_call_that_keeps_the_base_of_the_view_it_returns_runs_as_it_is(remote, keep):
    """The base, or another view of it, is held elsewhere too (``self.cache``): a replay
    could not set it. (A review found the other view replayed, and read stale, when a
    reference count stood for what held it.)"""
    kept = {"module": torch.nn.Module()}

    def fn(x):
        y = x * 2
        keep(y, kept)
        return y[:1]

    f = djinn.replayable(fn)
    for i in range(4):
        x = torch.full((2, 3), float(i))
        assert torch.equal(f(x.to(remote)).cpu(), (x * 2)[:1])
        held = kept["module"].cache if hasattr(kept["module"], "cache") else kept["y"]
        assert held.cpu().flatten()[-1].item() == 2 * i
    assert f.stats()["replays"] == 0, f.stats()
    assert (
        "it keeps a tensor it made that it does not return (aten::mul.Tensor)"
        in (f.stats()["plain"])
    )
