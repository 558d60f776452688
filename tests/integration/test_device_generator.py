"""Note [a GPU worker's generator] (djinn/frontend/seeded.py): on a GPU worker's session,
random ops draw from the remote device's own generator, a seed and an offset, as CUDA
eager's do from the GPU's; the local CPU generator is left alone.

This machine has no GPU: the client is told that its session's CPU worker is a GPU
(``on_gpu``), and the CPU worker seeds its generator from the seed and offset it is sent. What is
checked is the client's side (what the generator does, what a replay sends) and that the
worker draws the same numbers for the same state; test_gpu.py checks a CUDA worker."""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint

import djinn
from djinn.frontend import session
from tests.dropout_training import initialised_cpu_generator, train_with_dropout


@pytest.fixture
def on_gpu(remote, monkeypatch):
    real = session.current_device_type

    def as_a_gpu(start: bool = False) -> str | None:  # None still where no session is open
        kind = real(start)
        return "cuda" if kind == "cpu" else kind

    monkeypatch.setattr(session, "current_device_type", as_a_gpu)
    yield remote
    torch.manual_seed(0)  # the device generator is process-wide: leave it as seeded


def test_random_ops_draw_from_the_device_generator_and_leave_the_cpu_one_alone(on_gpu):
    """As CUDA eager: a remote draw moves the device's offset on, not the CPU generator;
    ``torch.manual_seed`` seeds the device's generator, so the same seed draws the same
    numbers, and every op draws fresh ones."""
    r = on_gpu
    torch.manual_seed(3)
    want_cpu = torch.rand(4)
    torch.manual_seed(3)
    a = torch.randn(1000, device=r)
    mask = torch.nn.functional.dropout(torch.ones(64, 64, device=r), 0.5)
    b = torch.randn(1000, device=r)
    assert torch.equal(torch.rand(4), want_cpu)  # the CPU generator never moved
    a, mask, b = a.cpu(), mask.cpu(), b.cpu()
    assert not torch.equal(a, b)
    assert set(mask.unique().tolist()) == {0.0, 2.0}
    torch.manual_seed(3)
    assert torch.equal(torch.randn(1000, device=r).cpu(), a)
    torch.manual_seed(4)
    assert not torch.equal(torch.randn(1000, device=r).cpu(), a)
    assert torch.remote_accelerator.initial_seed() == 4


def test_the_device_state_saves_and_restores_like_cudas(on_gpu):
    """``get_rng_state``/``set_rng_state`` of the device module, ``fork_rng`` and a
    checkpointed dropout (recomputed in backward with the mask of the forward: the same
    gradients as without the checkpoint)."""
    r = on_gpu
    torch.manual_seed(0)
    state = torch.remote_accelerator.get_rng_state()
    assert state.dtype == torch.uint8 and state.numel() == 16
    first = torch.rand(100, device=r).cpu()
    torch.remote_accelerator.set_rng_state(state)
    assert torch.equal(torch.rand(100, device=r).cpu(), first)
    with torch.random.fork_rng(device_type="remote_accelerator"):
        inside = torch.rand(100, device=r).cpu()
    assert torch.equal(torch.rand(100, device=r).cpu(), inside)
    bad = state.clone()
    bad[8] = 3  # an offset that is not a multiple of 4
    with pytest.raises(RuntimeError, match="multiple of 4"):
        torch.remote_accelerator.set_rng_state(bad)

    torch.manual_seed(1)
    lin = torch.nn.Linear(32, 32).to(r)
    x = torch.randn(16, 32).to(r)

    def block(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(lin(x).relu(), 0.5).sum(-1)

    grads = []
    for checkpointed in (False, True):
        lin.zero_grad()
        torch.manual_seed(9)
        y = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if checkpointed \
            else block(x)  # fmt: skip
        y.sum().backward()
        grads.append((y.detach().cpu(), lin.weight.grad.cpu()))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_a_replayed_step_with_dropout_draws_what_its_captured_run_draws(ahead, on_gpu):
    """Note [replayed draws] with the device generator: a replay moves its offset on as
    the captured ops did, so the replayed loop is the captured loop, bit for bit; the CPU
    generator is where the model's initialisation left it, and a Poisson sampler (which
    on the CPU generator would need its input's values read) replays."""
    losses, params, stats = train_with_dropout(on_gpu, True, 8, sampler=True)
    cpu_after, device_after = torch.get_rng_state(), torch.remote_accelerator.get_rng_state()
    assert stats["replays"] == 5 and stats["recordings"] == 2, stats
    want_losses, want_params, _ = train_with_dropout(on_gpu, False, 8, sampler=True)
    assert torch.equal(torch.remote_accelerator.get_rng_state(), device_after)
    for k, (got, want) in enumerate(zip(losses, want_losses, strict=True)):
        assert torch.equal(got, want), f"loss {k}"
    for got, want in zip(params, want_params, strict=True):
        assert torch.equal(got, want)
    assert torch.equal(cpu_after, initialised_cpu_generator())


def test_a_call_that_seeds_the_device_runs_as_it_is(on_gpu):
    """A seed inside the call moves the device generator as no replay would: the call
    runs as it is, and its numbers are the same at every call."""
    r = on_gpu
    x = torch.ones(256, device=r)

    def fn(x: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(5)
        return torch.nn.functional.dropout(x, 0.5)

    run = djinn.replayable(fn)
    outs = [run(x).cpu() for _ in range(4)]
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert run.stats()["replays"] == 0, run.stats()
    assert any("generator" in why for why in run.stats()["plain"]), run.stats()


def test_draws_before_the_session_opens_and_huge_bounds_are_fresh(on_gpu):
    """A review's two ways to get the same numbers twice: a ``fork_rng`` entered before
    any session was open saved the CPU state, so the device's draws inside went
    unrestored; and a ``randint`` bound counted into the offset's increment wrapped it
    round to where it was."""
    r = on_gpu
    session.reset()
    torch.manual_seed(0)
    with torch.random.fork_rng(device_type="remote_accelerator"):
        a = torch.randn(4, device=r).cpu()
    assert torch.equal(torch.randn(4, device=r).cpu(), a)
    high = (1 << 62) - 36  # 4 * high + 4 * 10 + 64 == 2**64 under the old count
    b, c = (torch.randint(0, high, (10,), device=r).cpu() for _ in range(2))
    assert not torch.equal(b, c)


def test_a_seed_before_import_djinn_seeds_the_device(tmp_path):
    """``torch.manual_seed`` before ``import djinn`` did not reach the device module: the
    device's generator starts from the CPU one's initial seed."""
    import subprocess
    import sys

    code = (
        "import torch; torch.manual_seed({}); import djinn; "
        "from djinn.frontend.seeded import DEVICE_GENERATOR as g; print(g.seed, g.offset)"
    )
    for seed in (5, 6):
        out = subprocess.run([sys.executable, "-c", code.format(seed)], capture_output=True,
                             text=True, timeout=120, check=True).stdout.split()  # fmt: skip
        assert out == [str(seed), "0"]


@pytest.mark.parametrize("where", ["torch.cuda", "torch.cuda.random"])
def test_torch_cuda_manual_seed_under_djinn_run_seeds_the_device_alone(on_gpu, where):
    """Under ``djinn run`` (which holds CUDA_QUERIES), ``torch.cuda.manual_seed`` and its
    ``_all`` seed the remote device's generator, as CUDA's seed the GPU's, and leave the
    CPU generator alone; ``torch.cuda.seed`` draws a fresh seed for it. The same functions
    called as ``torch.cuda.random``'s do the same; all are PyTorch's again after."""
    import importlib

    from djinn.frontend.extension_points import CUDA_QUERIES

    r = on_gpu
    module = importlib.import_module(where)
    theirs = module.manual_seed
    torch.manual_seed(1)
    want_cpu = torch.rand(4)
    torch.manual_seed(1)
    with CUDA_QUERIES.held():
        module.manual_seed(9)
        a = torch.randn(100, device=r).cpu()
        module.manual_seed_all(9)
        b = torch.randn(100, device=r).cpu()
        module.manual_seed(10)
        c = torch.randn(100, device=r).cpu()
        module.seed()
        d = torch.randn(100, device=r).cpu()
        assert torch.remote_accelerator.initial_seed() != 10
    assert torch.equal(torch.rand(4), want_cpu)  # the CPU generator never moved
    assert torch.equal(a, b)
    assert not torch.equal(a, c) and not torch.equal(c, d)
    assert module.manual_seed is theirs


def test_torch_cuda_manual_seed_under_djinn_run_leaves_a_cpu_session_as_eager(remote):
    """On a CPU worker's session remote draws are CPU eager's: ``torch.cuda.manual_seed``
    changes them no more than it changes a CPU script's on a machine without CUDA."""
    from djinn.frontend.extension_points import CUDA_QUERIES

    torch.manual_seed(2)
    want = torch.randn(100)
    torch.manual_seed(2)
    with CUDA_QUERIES.held():
        torch.cuda.manual_seed(9)
        got = torch.randn(100, device=remote).cpu()
    assert torch.equal(got, want)
