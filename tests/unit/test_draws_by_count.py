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


def test_a_draw_is_made_again_on_a_private_generator_by_an_overload_of_the_same_call():
    """``Draw.on`` (a recording's check, Note [replayed draws]): the op itself where it
    takes a generator, else its overload that adds one to the same arguments, else none
    (dropout is drawn as its kernel draws its mask)."""
    from djinn.frontend.seeded import _with_generator

    aten = torch.ops.aten
    assert _with_generator(aten.bernoulli_.float) is aten.bernoulli_.float
    assert _with_generator(aten.randn.default) is aten.randn.generator
    assert _with_generator(aten.randint.low) is aten.randint.low_generator
    assert _with_generator(aten.randint_like.Tensor) is aten.randint_like.Tensor_generator
    assert _with_generator(aten.randint_like.low_dtype) is None  # its overload is named otherwise
    assert _with_generator(aten.native_dropout.default) is None


def test_dropout_drawn_again_on_a_private_generator_moves_it_as_the_op_moves_the_default():
    from djinn.frontend.seeded import Draw

    cases = [((4, 8), 0.5, True), ((1000, 37), 0.1, True), ((3,), 0.9, None)]
    cases += [((0, 3), 0.5, True), ((5, 3), 0.5, False)]  # the kernel draws nothing
    for shape, p, train in cases:
        x = torch.randn(*shape)
        start = torch.get_rng_state()
        torch.ops.aten.native_dropout.default(x, p, train)
        after = torch.get_rng_state()
        trial = torch.Generator()
        trial.set_state(start)
        assert Draw(torch.ops.aten.native_dropout.default, (x, p, train), {}).on(trial)
        assert torch.equal(trial.get_state(), after)
        assert torch.equal(torch.get_rng_state(), after)  # the default one left alone
