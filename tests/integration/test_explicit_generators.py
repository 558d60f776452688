"""Note [explicit generators] (djinn/frontend/own_generators.py): a random op on the remote device
given a CPU generator of the program's own draws what eager draws from it, moves that
generator on as eager does, and leaves the default generator alone. Before, every such
op was refused ("cannot send a Generator argument")."""

from __future__ import annotations

import pytest
import torch

import djinn
from djinn.errors import UnsupportedOp

DRAWS = {
    "randn": lambda g, d: torch.randn(3, 4, generator=g, device=d),
    "rand float16": lambda g, d: torch.rand(5, generator=g, device=d, dtype=torch.float16),
    "randint": lambda g, d: torch.randint(0, 10, (6,), generator=g, device=d),
    "randperm": lambda g, d: torch.randperm(9, generator=g, device=d),
    "normal_": lambda g, d: torch.empty(4, device=d).normal_(2, 3, generator=g),
    "exponential_": lambda g, d: torch.empty(4, device=d).exponential_(generator=g),
    "bernoulli": lambda g, d: torch.full((7,), 0.3, device=d).bernoulli(generator=g),
    "multinomial": lambda g, d: torch.multinomial(
        torch.tensor([0.1, 0.5, 0.4], device=d), 5, True, generator=g
    ),
    # samplers that draw as many numbers as their inputs' values say, generator positional
    "poisson": lambda g, d: torch.poisson(torch.tensor([1.0, 4.0, 9.0], device=d), generator=g),
    "binomial": lambda g, d: torch.binomial(
        torch.tensor([5.0, 9.0], device=d), torch.tensor([0.3, 0.6], device=d), generator=g
    ),
    "init.kaiming_uniform_": lambda g, d: torch.nn.init.kaiming_uniform_(
        torch.empty(3, 3, device=d), generator=g
    ),
    "beside a default draw": lambda g, d: (
        torch.randn(3, 4, generator=g, device=d) + torch.randn(3, 4, device=d)
    ),
}


@pytest.mark.parametrize("draw", DRAWS.values(), ids=DRAWS.keys())
def test_an_explicit_generator_draws_and_moves_as_in_eager(remote, draw):
    def run(device: str) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(3)
        torch.manual_seed(1)
        got = [draw(g, device).cpu() for _ in range(2)]
        return got, g.get_state(), torch.rand(2)  # the default generator, after

    want, got = run("cpu"), run(remote)
    assert all(torch.equal(a, b) for a, b in zip(got[0], want[0], strict=True))
    assert torch.equal(got[1], want[1])  # the program's generator moved on as in eager
    assert torch.equal(got[2], want[2])  # and the default one only by the default draws


def test_a_replayable_call_with_an_explicit_generator_runs_as_it_is(remote):
    """A call may pass another generator each time; a replay would draw from the
    recording's: such a call runs as it is, with eager's numbers."""

    def noisy(x, g):
        return x + torch.randn(x.shape, generator=g, device=x.device)

    run = djinn.replayable(noisy)
    x = torch.zeros(8)
    want = [noisy(x, torch.Generator().manual_seed(s)) for s in (1, 2, 3, 4)]
    got = [run(x.to(remote), torch.Generator().manual_seed(s)).cpu() for s in (1, 2, 3, 4)]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert run.stats()["replays"] == 0, run.stats()
    assert "it draws from a generator of its own (generator=)" in run.stats()["plain"]


def test_a_replayable_call_that_draws_locally_from_its_own_generator_runs_as_it_is(remote):
    """A local draw from a program's generator steering the call (a review: replayed with
    the recording's branch, 8 of 12 calls wrong, the generator never moved): it runs as it
    is, as a local draw from the default generator does."""

    def step(x, g):
        if torch.rand(1, generator=g).item() < 0.5:
            return x * 2
        return x - 1

    run = djinn.replayable(step)
    x = torch.ones(3)
    g_local, g_remote = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    want = [step(x, g_local) for _ in range(12)]
    got = [run(x.to(remote), g_remote).cpu() for _ in range(12)]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert torch.equal(g_remote.get_state(), g_local.get_state())
    assert run.stats()["replays"] == 0, run.stats()
    assert "it draws from a generator of its own (generator=)" in run.stats()["plain"]

    def dropout_step(x):  # Djinn's own trial generators (draws by count) do not count
        return torch.nn.functional.dropout(x, 0.5) * 3

    run = djinn.replayable(dropout_step)
    torch.manual_seed(2)
    want = [dropout_step(torch.ones(64)) for _ in range(5)]
    torch.manual_seed(2)
    got = [run(torch.ones(64).to(remote)).cpu() for _ in range(5)]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert run.stats()["replays"] >= 2, run.stats()


def test_a_generator_that_cannot_draw_for_the_appliance_is_refused(remote, monkeypatch):
    """Typed, naming the op: a generator object that is not a CPU one (a stand-in here:
    this machine has no CUDA generator), and any generator on a GPU worker's session,
    whose ops draw from the device's own generator."""
    from djinn.frontend import own_generators

    class NotCpu:
        device = torch.device("cuda")

    with pytest.raises(UnsupportedOp, match=r"aten::normal_.*generator on cuda"):
        own_generators.advance(torch.ops.aten.normal_.default, (), {}, lambda t: t, NotCpu())
    monkeypatch.setattr(own_generators, "draws_on_device", lambda: True)
    with pytest.raises(UnsupportedOp, match="GPU worker's session"):
        torch.randn(3, generator=torch.Generator().manual_seed(0), device=remote)
