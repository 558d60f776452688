"""Note [graph plans] and Note [compiled plans] end to end: a training loop whose steps
the worker runs by plans, compiled or not, ends with the very parameters of the same loop
on a worker that interprets every step, and the stats document says how many requests
plans ran."""

from __future__ import annotations

import torch

from tests.conftest import frontend_at, wait_for

R = "remote_accelerator:0"


def _train(app, steps: int) -> list[torch.Tensor]:
    """An MLP with dropout (a random op in every step) trained with Adam on ``app``
    through the transparent frontend; its parameters after ``steps`` steps."""
    with frontend_at(app.unix):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1)
        ).to(R)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(1)
        for _ in range(steps):
            x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 1, generator=gen)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x.to(R)), y.to(R))
            loss.backward()
            opt.step()
        return [p.detach().cpu() for p in model.parameters()]


def _plans(app) -> dict:
    return app.stats()["scheduler"][0]["graph_plans"]


def test_a_loop_run_by_plans_ends_with_the_parameters_of_one_interpreted(fresh_appliance):
    compiled = fresh_appliance(graph_plan_after=1)  # Note [compiled plans]: after one plan run
    planned = fresh_appliance(graph_plan_after=1, graph_compile_after=0)
    interpreted = fresh_appliance(graph_plan_after=0)
    want = _train(interpreted, 8)
    for app in (compiled, planned):
        for g, w in zip(_train(app, 8), want, strict=True):
            assert torch.equal(g, w)  # the same kernels on the same values: bit-identical
    plans = wait_for(lambda: (p := _plans(compiled))["compiled_runs"] and p)
    assert plans["recorded"] >= 1 and plans["compiled"] >= 1 and plans["uncompiled"] == 0
    assert plans["runs"] > plans["compiled_runs"]  # the first plan run is not compiled
    plans = wait_for(lambda: (p := _plans(planned))["runs"] and p)
    assert plans["compiled"] == plans["compiled_runs"] == 0
    assert _plans(interpreted) == {"plans": 0, "nodes": 0, "runs": 0, "recorded": 0,
                                   "refused": 0, "compiled": 0, "compiled_runs": 0,
                                   "uncompiled": 0}  # fmt: skip
