"""Note [draws by count] (djinn/frontend/seeded.py): a Draw of a random op whose CPU kernel
takes a fixed count of the generator's outputs per element moves the generator on by that
count once it has seen it twice; the generator ends where the op itself leaves it."""

from __future__ import annotations

import pytest
import torch

from djinn.frontend import seeded

A = torch.ops.aten
CASES = {
    "dropout": (A.native_dropout.default, lambda: (torch.full((16, 33), 0.5), 0.1, True), {}),
    "bernoulli_": (A.bernoulli_.float, lambda: (torch.empty(5), 0.3), {}),
    "bernoulli of a tensor p": (A.bernoulli.default, lambda: (torch.full((7,), 0.2),), {}),
    "rand odd": (A.rand.default, lambda: ([7, 3],), {}),
    "rand float64": (A.rand.default, lambda: ([4],), {"dtype": torch.float64}),
    "randint": (A.randint.low, lambda: (0, 10, [9]), {}),
    "random_ int64": (A.random_.default, lambda: (torch.empty(6, dtype=torch.int64),), {}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_counted_draw_ends_where_the_op_does(name):
    func, args, kwargs = CASES[name]
    draw = seeded.Draw(func, args(), kwargs)
    torch.manual_seed(0)
    torch.randn(3)  # a cached normal sample in the state: counts must leave it as it is
    for _ in range(6):
        draw.again()
    got = torch.get_rng_state()
    torch.manual_seed(0)
    torch.randn(3)
    for _ in range(6):
        func(*args(), **kwargs)
    assert torch.equal(got, torch.get_rng_state())
    assert draw.learnt == seeded.LEARN and draw.count is not None


def test_an_op_that_draws_otherwise_keeps_running_as_it_is(monkeypatch):
    """normal_ of a few elements takes its cached sample: no count gives its state, so its
    Draw runs it at every draw, and the generator still ends where eager's does."""
    func = A.normal_.default
    monkeypatch.setattr(seeded, "COUNTED", seeded.COUNTED | {func})
    draw = seeded.Draw(func, (torch.empty(3),), {})
    torch.manual_seed(1)
    for _ in range(5):
        draw.again()
    got = torch.get_rng_state()
    torch.manual_seed(1)
    for _ in range(5):
        torch.empty(3).normal_()
    assert torch.equal(got, torch.get_rng_state())
    assert draw.learnt == -1
