"""Note [replayable functions]: training steps replayed (their backward pass, their
gradients in ``.grad``, their optimizers), with local eager's or a capture's bits, and
what changes a step between calls seen before it replays."""

from __future__ import annotations

import copy

import pytest
import torch

import djinn


def _moved(model: torch.nn.Module, remote: str) -> torch.nn.Module:
    return copy.deepcopy(model).to(remote)


def _encoder() -> torch.nn.Module:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    return torch.nn.Sequential(
        torch.nn.TransformerEncoder(layer, 1, enable_nested_tensor=False), torch.nn.Linear(16, 1)
    )


def _train(model, make_opt, batches, replay, zero_inside=True):
    opt = make_opt(model.parameters())

    def step(x, y):
        if zero_inside:
            opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    run = djinn.replayable(step) if replay else step
    losses = []
    for x, y in batches:
        if not zero_inside:
            opt.zero_grad()
        losses.append(run(x, y))
    return losses, run


def _batches(device, n=6):
    gen = torch.Generator().manual_seed(3)
    return [
        (
            torch.randn(4, 5, 16, generator=gen).to(device),
            torch.randn(4, 5, 1, generator=gen).to(device),
        )
        for _ in range(n)
    ]


def test_an_sgd_training_step_replays_with_local_eagers_bits(remote):
    local = _encoder()
    model = _moved(local, remote)
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)  # noqa: E731
    want, _ = _train(local, sgd, _batches("cpu"), replay=False)
    got, run = _train(model, sgd, _batches(remote), replay=True)
    assert all(torch.equal(g.cpu(), w.detach()) for g, w in zip(got, want, strict=True))
    for p, q in zip(model.parameters(), local.parameters(), strict=True):
        assert torch.equal(p.detach().cpu(), q.detach())
        assert torch.equal(p.grad.cpu(), q.grad)  # the gradients a replay left in .grad
    stats = run.stats()
    # the first step makes the momentum buffers; the next two record; the rest replay
    assert stats["replays"] == 3 and stats["recordings"] == 2, stats


def test_a_replays_body_is_made_only_where_it_is_read(remote, monkeypatch):
    """Note [bodies made when read] (djinn/protocol/templates.py): a replay goes by
    fingerprint and its journal entry by its template's facts, so after the first replay
    of a template no replay's body is made; a cut made now walks the journal without
    making them either, and the loop keeps local eager's bits."""
    from djinn.frontend import inflight
    from djinn.frontend.session import default_session
    from djinn.protocol import templates

    made = []
    real = templates.Filled.made
    monkeypatch.setattr(
        templates.Filled, "made", lambda self: made.append(self._body is None) or real(self)
    )
    local = _encoder()
    model = _moved(local, remote)
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)  # noqa: E731
    want, _ = _train(local, sgd, _batches("cpu", 12), replay=False)
    got, run = _train(model, sgd, _batches(remote, 12), replay=True)
    inflight.land_all()
    assert run.stats()["replays"] == 9, run.stats()
    assert sum(made) <= 1, made  # the first replay of the template: its journal facts
    lineage = default_session()._lineage
    if lineage is not None:
        lineage.checkpoint()
    assert all(torch.equal(g.cpu(), w.detach()) for g, w in zip(got, want, strict=True))
    for p, q in zip(model.parameters(), local.parameters(), strict=True):
        assert torch.equal(p.detach().cpu(), q.detach())
    assert sum(made) <= 1, made


def test_a_capturable_adam_step_replays_with_the_captured_loops_bits(remote):
    adam = lambda ps: torch.optim.Adam(ps, lr=1e-2, capturable=True)  # noqa: E731
    captured = _moved(_encoder(), remote)
    replayed = _moved(_encoder(), remote)
    _train(captured, adam, _batches(remote), replay=False)
    _, run = _train(replayed, adam, _batches(remote), replay=True)
    for p, q in zip(replayed.parameters(), captured.parameters(), strict=True):
        assert torch.equal(p.detach().cpu(), q.detach().cpu())
    assert run.stats()["replays"] == 3, run.stats()


def _scheduled(m, device: str, replay: bool, scheduler, calls: int):
    """SGD on ``m`` for ``calls`` calls, ``scheduler(opt)`` stepped after each, outside
    the step; the replayable function when ``replay``."""
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    sched = scheduler(opt)

    def step(x, y):
        opt.zero_grad()
        torch.nn.functional.mse_loss(m(x), y).backward()
        opt.step()

    run = djinn.replayable(step) if replay else step
    for x, y in _batches(device, calls):
        run(x, y)
        sched.step()
    return run


def test_a_learning_rate_changed_by_a_scheduler_records_again(remote):
    local = _encoder()
    model = _moved(local, remote)
    # every third step, a new learning rate the graph holds as a float
    every_third = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.1)  # noqa: E731
    _scheduled(local, "cpu", False, every_third, 8)
    run = _scheduled(model, remote, True, every_third, 8)
    for p, q in zip(model.parameters(), local.parameters(), strict=True):
        assert torch.equal(p.detach().cpu(), q.detach())
    # calls 1-2 record, 3 replays; 4 and 7 find a new learning rate and record, and
    # each such recording is like the one before (its graph holds no learning rate: the
    # step runs), so 5, 6 and 8 replay (Note [state that changes at every call])
    assert run.stats()["recordings"] == 4 and run.stats()["replays"] == 4, run.stats()


def test_a_learning_rate_set_at_every_call_pauses_recording(remote):
    """Note [state that changes at every call]: a scheduler stepped after every call; no
    replay can run, and the key stops recording at every call (it recorded 29 of 30)."""
    local = _encoder()
    model = _moved(local, remote)
    every_call = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))  # noqa: E731
    _scheduled(local, "cpu", False, every_call, 12)
    run = _scheduled(model, remote, True, every_call, 12)
    for p, q in zip(model.parameters(), local.parameters(), strict=True):
        assert torch.equal(p.detach().cpu(), q.detach())
    stats = run.stats()
    assert stats["replays"] == 0 and stats["recordings"] <= 4, stats
    assert stats["plain"][
        "what it is checked by changes between calls (a scheduler's learning rate)"
    ]


def test_zero_grad_outside_the_step_still_gets_fresh_gradients(remote):
    local = _encoder()
    model = _moved(local, remote)
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.05)  # noqa: E731
    _train(local, sgd, _batches("cpu"), replay=False, zero_inside=False)
    _, run = _train(model, sgd, _batches(remote), replay=True, zero_inside=False)
    for p, q in zip(model.parameters(), local.parameters(), strict=True):
        assert torch.equal(p.detach().cpu(), q.detach())
        assert torch.equal(p.grad.cpu(), q.grad)
    assert run.stats()["replays"] == 4, run.stats()


def test_a_layer_frozen_after_replays_start_stays_frozen(remote):
    local = _encoder()
    model = _moved(local, remote)
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)  # noqa: E731
    want_opt, got_opt = sgd(local.parameters()), sgd(model.parameters())

    def step(m, opt, x, y):
        opt.zero_grad()
        torch.nn.functional.mse_loss(m(x), y).backward()
        opt.step()

    fwd = djinn.replayable(lambda x, y: step(model, got_opt, x, y))
    for i, ((x, y), (rx, ry)) in enumerate(
        zip(_batches("cpu", 8), _batches(remote, 8), strict=True)
    ):
        if i == 5:
            for m in (local, model):
                m[1].weight.requires_grad_(False)
        step(local, want_opt, x, y)
        fwd(rx, ry)
    for p, q in zip(model.parameters(), local.parameters(), strict=True):
        assert torch.equal(p.detach().cpu(), q.detach())
    assert fwd.stats()["replays"] >= 2


def test_a_gradient_kept_from_an_earlier_step_keeps_its_value(remote):
    model = _moved(_encoder(), remote)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    kept = []

    @djinn.replayable
    def step(x, y):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    for x, y in _batches(remote, 5):
        step(x, y)
        w = model[1].weight
        kept.append((w.grad, w.grad.cpu()))
    assert step.stats()["replays"] == 3
    for grad, value in kept:
        assert torch.equal(grad.cpu(), value)
    assert len({id(g) for g, _ in kept}) == 5


def _sgd_loop(model, opt, batches, run, between=None):
    for i, (x, y) in enumerate(batches):
        if between is not None:
            between(i)
        run(x, y)


def _step_of(model, opt, zero=True):
    def step(x, y):
        if zero:
            opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    return step


def _twins(remote):
    local = _encoder()
    return local, _moved(local, remote)


@pytest.mark.parametrize(
    "change",
    ["gradients accumulate", "a gradient hook", "a learning rate tensor", "optimizer state"],
)
def test_what_changes_a_training_step_between_calls_is_seen(remote, change):
    local, model = _twins(remote)
    lr = {"a learning rate tensor": lambda: torch.tensor(0.05)}.get(change, lambda: 0.05)
    opts = [torch.optim.SGD(m.parameters(), lr=lr(), momentum=0.9) for m in (local, model)]
    zero = change != "gradients accumulate"
    steps = [_step_of(m, o, zero) for m, o in zip((local, model), opts, strict=True)]
    fwd = djinn.replayable(steps[1])
    saved = [o.state_dict() for o in opts]

    def between(i, m, o, keep):
        if i == 5 and change == "gradients accumulate":
            return  # no zero_grad from here on: .grad must add up
        if change == "gradients accumulate" and i < 5:
            o.zero_grad()
        if i == 5 and change == "a gradient hook":
            m[1].weight.register_hook(lambda g: g * 3)
        if i == 5 and change == "a learning rate tensor":
            o.param_groups[0]["lr"].fill_(0.01)
        if i == 5 and change == "optimizer state":
            o.load_state_dict(keep)

    for m, o, run, keep in zip((local, model), opts, (steps[0], fwd), saved, strict=True):
        batches = _batches("cpu" if m is local else remote, 8)
        _sgd_loop(m, o, batches, run, lambda i, m=m, o=o, keep=keep: between(i, m, o, keep))
    for p, q in zip(model.parameters(), local.parameters(), strict=True):
        assert torch.allclose(p.detach().cpu(), q.detach(), atol=1e-6), change
    assert fwd.stats()["replays"] >= 1, fwd.stats()


def test_a_new_optimizer_whose_scheduler_steps_inside_the_call_is_watched(remote):
    """A replay that misses because the optimizer it was checked by is gone records
    afresh: a kept record would watch the dead optimizer and miss the new scheduler
    stepped inside ``fn`` (found by review of Note [state that changes at every call]:
    the new optimizer's decaying learning rate was frozen at 0.05, 0.19 off eager)."""
    import gc

    def train(device, replay):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                    torch.nn.Linear(16, 1)).to(device)  # fmt: skip
        held = {}

        def new(decay):
            held["opt"] = torch.optim.SGD(model.parameters(), lr=0.1)
            held["sched"] = torch.optim.lr_scheduler.LambdaLR(held["opt"], decay)

        def step(x, y):
            held["opt"].zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            held["opt"].step()
            held["sched"].step()

        run = djinn.replayable(step) if replay else step
        gen = torch.Generator().manual_seed(1)
        data = [(torch.randn(4, 8, generator=gen), torch.randn(4, 1, generator=gen))
                for _ in range(10)]  # fmt: skip
        new(lambda s: 1.0)
        for x, y in data[:5]:
            run(x.to(device), y.to(device))
        new(lambda s: 0.5**s)
        gc.collect()
        for x, y in data[5:]:
            run(x.to(device), y.to(device))
        return model, held["opt"]

    want, want_opt = train("cpu", False)
    got, got_opt = train(remote, True)
    assert got_opt.param_groups[0]["lr"] == want_opt.param_groups[0]["lr"]
    for p, q in zip(got.parameters(), want.parameters(), strict=True):
        assert torch.equal(p.detach().cpu(), q.detach())


class _HeadWithItsLoss(torch.nn.Module):
    """As a transformers classification head does: a loss module made at every call."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 3)

    def forward(self, x, y):
        return torch.nn.CrossEntropyLoss()(self.lin(x), y)


def test_a_module_the_call_makes_and_drops_does_not_stop_replays(remote):
    local = _HeadWithItsLoss()
    model = _moved(local, remote)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (local, model)]

    def step(m, opt, x, y):
        loss = m(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    run = djinn.replayable(lambda x, y: step(model, opts[1], x, y))
    for _ in range(6):
        x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
        want = step(local, opts[0], x, y)
        assert torch.equal(run(x.to(remote), y.to(remote)).cpu(), want)
    # before: "a module, optimizer or tensor it uses changed since" at every call
    assert run.stats()["replays"] == 4, run.stats()
    for a, b in zip(local.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b.cpu())
