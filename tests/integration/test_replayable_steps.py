"""Note [optimizer steps run, not replayed] (djinn/frontend/replay_steps.py): training
steps whose optimizer steps run at every replay (the default Adam's), and what a replay
must leave as eager does (every ``.grad``, the optimizers' state, state the call changes)."""

from __future__ import annotations

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._pytree import tree_leaves, tree_map

import djinn
from tests.integration.test_replayable_training import _batches, _encoder, _moved, _train


def _both(train, remote, local=None):
    """``train(model, device, replay)`` on local eager and, replayed, on the remote device
    from the same weights: their outputs and parameters are the same bits. (local, the
    remote model, its Replayable)."""
    local = _encoder() if local is None else local
    model = _moved(local, remote)
    want, _ = train(local, "cpu", False)
    got, run = train(model, remote, True)
    assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want, strict=True))
    for p, q in zip(model.parameters(), local.parameters(), strict=True):
        assert torch.equal(p.detach().cpu(), q.detach())
    return local, model, run


def test_a_default_adam_step_replays_and_steps_with_local_eagers_bits(remote):
    """Its bias corrections are Python floats that change every step, so the whole call
    never records alike: its forward and backward replay, and the optimizer's step runs
    at every call after them (Note [optimizer steps run, not replayed])."""
    local = _encoder()
    model = _moved(local, remote)
    adam = lambda ps: torch.optim.Adam(ps, lr=1e-2)  # noqa: E731
    want, _ = _train(local, adam, _batches("cpu", 9), replay=False)
    got, run = _train(model, adam, _batches(remote, 9), replay=True)
    assert all(torch.equal(g.cpu(), w.detach()) for g, w in zip(got, want, strict=True))
    for p, q in zip(model.parameters(), local.parameters(), strict=True):
        assert torch.equal(p.detach().cpu(), q.detach())
        assert torch.equal(p.grad.cpu(), q.grad)
    stats = run.stats()
    # its first step makes its state (run as it is); the next two record, and the second
    # one's forward and backward are as the first one's, its floats not
    assert stats["replays"] == 6 and stats["recordings"] == 2, stats


def _adam_loop(m, device, replay, n=9, zero_after=False, scheduled=False):
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.1)
    steps = []
    opt.register_step_post_hook(lambda o, args, kwargs: steps.append(1))

    def step(x, y):
        if not zero_after:
            opt.zero_grad()
        loss = torch.nn.functional.mse_loss(m(x), y)
        loss.backward()
        opt.step()
        if zero_after:
            opt.zero_grad()
        return loss.detach()

    run = djinn.replayable(step) if replay else step
    losses = []
    for x, y in _batches(device, n):
        losses.append(run(x, y))
        if scheduled:
            sched.step()
    return losses, run, steps


def test_a_stepped_optimizer_runs_its_hooks_and_a_new_learning_rate_records_again(remote):
    """The step runs with the learning rate as it is, but ``fn`` could read it before
    the step (a weight decay of its own): a new one records again."""
    local = _encoder()
    model = _moved(local, remote)
    want, _, want_steps = _adam_loop(local, "cpu", False, scheduled=True)
    got, run, got_steps = _adam_loop(model, remote, True, scheduled=True)
    assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want, strict=True))
    for p, q in zip(model.parameters(), local.parameters(), strict=True):
        assert torch.equal(p.detach().cpu(), q.detach())
    stats = run.stats()
    assert stats["plain"]["a module, optimizer or tensor it uses changed since"] == 2, stats
    # each new learning rate costs one recording, like the one before: replays go on
    assert stats["replays"] == 4 and stats["recordings"] == 4, stats
    assert len(got_steps) == len(want_steps) == 9  # the optimizer's own hooks ran each time


def test_a_step_followed_by_zero_grad_is_not_run_after_a_replay(remote):
    """The gradients the step read are gone when the call ends, so a replay could not put
    them back in ``.grad`` for a step run after it: the call is replayed whole or not at
    all (the default Adam's floats change: not at all), never with its step given no
    gradients."""
    local = _encoder()
    model = _moved(local, remote)
    _adam_loop(local, "cpu", False, zero_after=True)
    _, run, _ = _adam_loop(model, remote, True, zero_after=True)
    for p, q in zip(model.parameters(), local.parameters(), strict=True):
        assert torch.equal(p.detach().cpu(), q.detach())
        assert p.grad is None and q.grad is None
    assert run.stats()["replays"] == 0, run.stats()


def test_two_optimizers_stepping_in_turn_both_run_at_every_call(remote):
    """A GAN-like step: two optimizers, each over a part of the model, step one after the
    other at the end of the call, and both run at every replay."""

    def train(m, device, replay):
        first = torch.optim.Adam(m[0].parameters(), lr=1e-2)
        second = torch.optim.SGD(m[1].parameters(), lr=0.05, momentum=0.9)

        def step(x, y):
            first.zero_grad()
            second.zero_grad()
            loss = torch.nn.functional.mse_loss(m(x), y)
            loss.backward()
            first.step()
            second.step()
            return loss.detach()

        run = djinn.replayable(step) if replay else step
        return [run(x, y) for x, y in _batches(device, 7)], run

    _local, _model, run = _both(train, remote)
    assert run.stats()["replays"] == 4, run.stats()


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _heads() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.ModuleDict(
        {"trunk": torch.nn.Linear(8, 8), "a": torch.nn.Linear(8, 1), "b": torch.nn.Linear(8, 1)}
    )


def _mse_step(m, opt, x, y, head=None):
    opt.zero_grad()
    out = m(x) if head is None else m[head](m["trunk"](x))
    loss = torch.nn.functional.mse_loss(out, y)
    loss.backward()
    opt.step()
    return loss.detach()


def _returns_a_gradient(m, opt, x, y):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(m(x), y)
    loss.backward()
    opt.step()
    return loss.detach(), m[2].bias.grad


def _returns_the_learning_rate(m, opt, x, y):
    return _mse_step(m, opt, x, y), opt.param_groups[0]["lr"]


def _halve_the_learning_rate(m, opt, i, device):
    if i % 4 == 3:
        opt.param_groups[0]["lr"] /= 2


def _a_head_trained_outside(m, opt, i, device):
    """Between calls: ``zero_grad``, then (from the sixth call on) a backward through the
    head the call does not use, whose gradient the call's step then uses."""
    opt.zero_grad()
    if i >= 5:
        m["b"](torch.ones(2, 8).to(device)).sum().backward()


def _trunk_and_head_a(m, opt, x, y):
    loss = torch.nn.functional.mse_loss(m["a"](m["trunk"](x)), y)
    loss.backward()
    opt.step()
    return loss.detach()


def _scheduled_inside(m, opt, x, y):
    loss = _mse_step(m, opt, x, y)
    opt.scheduler.step()
    return loss


class _CountingSGD(torch.optim.Optimizer):
    """SGD that counts its steps in its param group (as timm's Lamb does) and pulls the
    weights back halfway every third step (as Lookahead does)."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.05})
        for group in self.param_groups:
            group["step"] = 0

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            group["step"] += 1
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])
                    if group["step"] % 3 == 0:
                        p.mul_(0.5)


def _scheduled_adam(ps):
    opt = torch.optim.Adam(ps, lr=1e-2)
    opt.scheduler = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.9)
    return opt


def _halve_the_gradients(opt, _args, _kwargs):
    for p in opt.param_groups[0]["params"]:
        p.grad.mul_(0.5)


def _as_local(value):
    return value.cpu() if isinstance(value, torch.Tensor) else value


@pytest.mark.parametrize(
    "case",
    [
        "a head chosen by argument",
        "a gradient returned",
        "the learning rate read",
        "an earlier global pre-hook",
        "rmsprop counts its steps",
        "adagrad counts its steps",
        "a gradient made outside the call",
        "a scheduler stepped inside",
        "a count in a param group",
    ],
)
def test_a_stepped_optimizer_leaves_what_eager_leaves(remote, case):
    """What a review of Note [optimizer steps run, not replayed] found wrong, each against
    local eager: outputs, parameters, ``.grad`` (None where eager's is) and optimizer
    state (a step count included)."""
    make = {
        "rmsprop counts its steps": lambda ps: torch.optim.RMSprop(ps, lr=1e-2),
        "adagrad counts its steps": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
        "a scheduler stepped inside": _scheduled_adam,
        "a count in a param group": _CountingSGD,
    }.get(case, lambda ps: torch.optim.Adam(ps, lr=1e-2))
    body = {
        "a gradient returned": _returns_a_gradient,
        "the learning rate read": _returns_the_learning_rate,
        "a gradient made outside the call": _trunk_and_head_a,
        "a scheduler stepped inside": _scheduled_inside,
    }.get(case, _mse_step)
    between = {
        "the learning rate read": _halve_the_learning_rate,
        "a gradient made outside the call": _a_head_trained_outside,
    }.get(case)
    heads = case in ("a head chosen by argument", "a gradient made outside the call")
    local = _heads() if heads else _mlp()
    results = []
    hook = None
    if case == "an earlier global pre-hook":  # registered before any recording
        hook = register_optimizer_step_pre_hook(_halve_the_gradients)
    try:
        for m, device in ((local, "cpu"), (_moved(local, remote), remote)):
            opt = make(m.parameters())

            def step(x, y, head, m=m, opt=opt):
                return body(m, opt, x, y, head) if head is not None else body(m, opt, x, y)

            run = djinn.replayable(step) if device == remote else step
            gen = torch.Generator().manual_seed(5)
            outs = []
            for i in range(10):
                x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 1, generator=gen)
                if between is not None:
                    between(m, opt, i, device)
                head = ("a", "b")[i % 2] if case == "a head chosen by argument" else None
                outs.append(tree_map(_as_local, run(x.to(device), y.to(device), head)))
            results.append((m, opt, outs, run))
    finally:
        if hook is not None:
            hook.remove()
    (lm, lopt, want, _), (rm, ropt, got, run) = results
    for g, w in zip(tree_leaves(got), tree_leaves(want), strict=True):
        assert torch.equal(g, w) if isinstance(w, torch.Tensor) else g == w, case
    for p, q in zip(rm.parameters(), lm.parameters(), strict=True):
        assert torch.equal(p.detach().cpu(), q.detach()), case
        assert (p.grad is None) == (q.grad is None), case
        assert q.grad is None or torch.equal(p.grad.cpu(), q.grad), case
    for p, q in zip(rm.parameters(), lm.parameters(), strict=True):
        for k, v in lopt.state[q].items():
            assert torch.equal(_as_local(ropt.state[p][k]), v), (case, k)
    for rg, lg in zip(ropt.param_groups, lopt.param_groups, strict=True):
        assert {k: v for k, v in rg.items() if k != "params"} == {
            k: v for k, v in lg.items() if k != "params"
        }, case
    # what a replay cannot reproduce is never replayed; the rest replays (a count in a
    # param group, which the step runs, only between the calls that see it changed)
    never = ("a scheduler stepped inside",)
    assert (run.stats()["replays"] == 0) == (case in never), run.stats()


def test_a_forward_keeps_no_dropped_model_alive(remote):
    """Its record holds no parameter: a model it ran, dropped, is freed."""
    import gc
    import weakref

    model = _moved(_mlp(), remote)
    weight = weakref.ref(model[0].weight)

    @djinn.replayable
    def predict(m, x):
        with torch.no_grad():
            return m(x)

    for x, _y in _batches(remote, 4):
        predict(model, x[:, 0, :8])
    assert predict.stats()["replays"] == 2, predict.stats()
    del model
    gc.collect()
    assert weight() is None


def test_a_mode_set_inside_the_step_after_one_set_outside_still_replays(remote):
    """``model.train()`` inside the step changed the mode once, after a ``model.eval()``
    outside it: the next recordings see no change, and replays go on."""
    local = _encoder()
    model = _moved(local, remote)

    def train(m, device, replay):
        opt = torch.optim.SGD(m.parameters(), lr=0.05)

        def step(x, y):
            m.train()
            return _mse_step(m, opt, x, y)

        run = djinn.replayable(step) if replay else step
        for i, (x, y) in enumerate(_batches(device, 9)):
            if i == 1:  # between the first two recordings
                m.eval()
            run(x, y)
        return run

    train(local, "cpu", False)
    run = train(model, remote, True)
    for p, q in zip(model.parameters(), local.parameters(), strict=True):
        assert torch.equal(p.detach().cpu(), q.detach())
    assert run.stats()["replays"] >= 3, run.stats()


def test_a_training_step_replays_only_from_a_compared_recording_even_after_one(remote):
    """What a step does to ``.grad`` and to state shows only against the recording before
    it, so ``after=1`` replays a training step from its third call on."""
    model = _moved(_encoder(), remote)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    run = djinn.replayable(after=1)(lambda x, y: _mse_step(model, opt, x, y))
    for x, y in _batches(remote, 5):
        run(x, y)
    assert run.stats()["recordings"] == 2 and run.stats()["replays"] == 3, run.stats()


def test_an_update_by_hand_sees_a_gradient_left_before_it(remote):
    """No optimizer: the step updates the weights in place and clears ``.grad`` itself. A
    gradient an outside backward left before a call is added in by eager's backward: the
    call records again rather than replay without it."""

    def train(m, device, replay):
        def step(x, y):
            loss = torch.nn.functional.mse_loss(m(x), y)
            loss.backward()
            with torch.no_grad():
                for p in m.parameters():
                    p -= 0.1 * p.grad
            m.zero_grad()
            return loss.detach()

        run = djinn.replayable(step) if replay else step
        losses = []
        for i, (x, y) in enumerate(_batches(device, 8)):
            if i == 5:
                m(torch.ones(2, 5, 16).to(device)).sum().backward()
            losses.append(run(x, y))
        return losses, run

    local, model, run = _both(train, remote)
    for p, q in zip(model.parameters(), local.parameters(), strict=True):
        assert p.grad is None and q.grad is None
    assert run.stats()["plain"].get("a .grad it found empty is not") == 1, run.stats()


def test_a_forward_sees_a_submodule_swapped_in(remote):
    """``model[1] = other`` while the old submodule lives on: the parent's children are
    part of the state check."""
    local = _mlp()
    model = _moved(local, remote)
    other = [torch.nn.Linear(16, 1), None]
    other[1] = _moved(torch.nn.Sequential(other[0]), remote)[0]
    kept = []  # the old heads stay alive
    run = djinn.replayable(lambda x: model(x))
    for i, (x, _y) in enumerate(_batches("cpu", 6)):
        x = x[:, 0, :8]
        if i == 4:
            kept.append((local[2], model[2]))
            local[2], model[2] = other
        with torch.no_grad():
            assert torch.equal(run(x.to(remote)).cpu(), local(x)), i
    assert run.stats()["replays"] >= 2, run.stats()


def test_a_subclassed_optimizer_calling_its_base_step_replays(remote):
    """``step()`` overridden to call ``super().step()``: PyTorch's step hooks wrap both
    once the base class has been instantiated, and the inner one, given the closure, is
    part of the outer step, not a step of its own."""
    torch.optim.Adam(_mlp().parameters())  # wraps Adam.step as well

    class Scaled(torch.optim.Adam):
        def step(self, closure=None):
            return super().step(closure)

    local = _encoder()
    model = _moved(local, remote)
    scaled = lambda ps: Scaled(ps, lr=1e-2)  # noqa: E731
    want, _ = _train(local, scaled, _batches("cpu", 6), replay=False)
    got, run = _train(model, scaled, _batches(remote, 6), replay=True)
    assert all(torch.equal(g.cpu(), w.detach()) for g, w in zip(got, want, strict=True))
    for p, q in zip(model.parameters(), local.parameters(), strict=True):
        assert torch.equal(p.detach().cpu(), q.detach())
    assert run.stats()["replays"] == 3, run.stats()


def test_a_gradient_assigned_from_an_argument_is_not_replayed(remote):
    """``p.grad = g`` is Python a replay would not run: its step would read the last
    recording's ``g``. The call runs as it is, with eager's numbers."""

    def train(m, device, replay):
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)

        def step(x, y, g):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(m(x), y)
            loss.backward()
            m[1].weight.grad = g
            opt.step()
            return loss.detach()

        run = djinn.replayable(step) if replay else step
        gen = torch.Generator().manual_seed(7)
        grads = [torch.randn(1, 16, generator=gen).to(device) for _ in range(6)]
        losses = [run(x, y, g) for (x, y), g in zip(_batches(device, 6), grads, strict=True)]
        return losses, run

    local, model, run = _both(train, remote)
    for p, q in zip(model.parameters(), local.parameters(), strict=True):
        assert torch.equal(p.grad.cpu(), q.grad)
    assert run.stats()["replays"] == 0, run.stats()
