"""A small training loop with dropout and the default Adam, for the tests of random ops
on a GPU worker's generator (test_gpu.py, test_device_generator.py)."""

from __future__ import annotations

import torch


def train_with_dropout(
    device: str, replay: bool, steps: int, sampler: bool = False
) -> tuple[list[torch.Tensor], list[torch.Tensor], dict]:
    """Losses, parameters after, and ``djinn.replayable``'s stats (empty when not
    replayed) of ``steps`` steps from ``torch.manual_seed(0)``. ``sampler``: the loss also
    takes a Poisson sample of the activations, which draws as many numbers as their values
    say (Note [seeded ops])."""
    import djinn

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Dropout(0.25), torch.nn.Linear(64, 1)
    ).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        h = model(x)
        loss = torch.nn.functional.mse_loss(h, y)
        if sampler:
            loss = loss + torch.poisson(h.detach().abs().expand(4, -1, -1)).mean() * 1e-3
        loss.backward()
        opt.step()
        return loss.detach()

    run = djinn.replayable(step) if replay else step
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(32, 16, generator=gen), torch.randn(32, 1, generator=gen)
        losses.append(run(x.to(device), y.to(device)).cpu())
    stats = run.stats() if replay else {}
    return losses, [p.detach().cpu() for p in model.parameters()], stats


def initialised_cpu_generator() -> torch.Tensor:
    """The CPU generator's state after ``train_with_dropout``'s model is made: where a GPU
    worker's session leaves it (Note [a GPU worker's generator])."""
    torch.manual_seed(0)
    torch.nn.Linear(16, 64), torch.nn.Linear(64, 1)
    return torch.get_rng_state()
