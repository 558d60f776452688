"""Note [replayed draws] (djinn/frontend/replay_record.py): random ops in a replayed call
(dropout in a training step) draw, at each replay, what eager draws from the local
generator; a call that uses that generator itself runs as it is."""

from __future__ import annotations

import pytest
import torch

import djinn
from tests.integration.test_followed_steps import _loop
from tests.integration.test_replayable_training import _moved


def test_a_step_with_dropout_replays_with_eagers_draws(ahead, remote):
    """Note [replayed draws]: an encoder trained with dropout replays (it used to run as it
    was at every call: "it draws random numbers"), each replay drawing its masks from the
    local generator as eager does: the same bits in every loss, parameter and gradient,
    and the same random numbers after the loop."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.25, batch_first=True)
    local = torch.nn.Sequential(
        torch.nn.TransformerEncoder(layer, 1, enable_nested_tensor=False), torch.nn.Linear(16, 1)
    ).train()
    model = _moved(local, remote)
    adam = lambda ps: torch.optim.Adam(ps, lr=1e-2)  # noqa: E731
    torch.manual_seed(7)
    want, _, _ = _loop(local, adam, "cpu", False)
    after_local = torch.rand(4)
    torch.manual_seed(7)
    got, run, _ = _loop(model, adam, remote, True)
    after_remote = torch.rand(4)
    assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want, strict=True))
    for p, q in zip(model.parameters(), local.parameters(), strict=True):
        assert torch.equal(p.detach().cpu(), q.detach())
        assert torch.equal(p.grad.cpu(), q.grad)
    assert torch.equal(after_remote, after_local)
    stats = run.stats()
    assert stats["replays"] == 5 and stats["steps_followed"] == 5, stats


def test_a_transformers_model_trained_with_dropout_replays_with_eagers_bits(ahead, remote):
    """Note [replayed draws] on a real model: a small GPT-2 (dropout 0.1 in its
    embeddings, attention and blocks, as the config defaults) trained on its own labels
    with AdamW replays, bit for bit eager's, the generator in step after."""
    import copy

    import transformers

    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=100, n_positions=16)
    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(cfg).train()
    got = {}
    for device in ("cpu", remote):
        model = copy.deepcopy(base).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step(ids, model=model, opt=opt):
            opt.zero_grad()
            loss = model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            return loss.detach()

        run = djinn.replayable(step) if device == remote else step
        torch.manual_seed(5)
        gen = torch.Generator().manual_seed(1)
        losses = [run(torch.randint(0, 100, (2, 12), generator=gen).to(device)).cpu()
                  for _ in range(8)]  # fmt: skip
        params = [p.detach().cpu() for p in model.parameters()]
        got[device] = (losses, params, torch.rand(3), run)
    (want, want_params, want_after, _), (have, params, after, run) = got["cpu"], got[remote]
    assert all(torch.equal(a, b) for a, b in zip(have, want, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(params, want_params, strict=True))
    assert torch.equal(after, want_after)
    assert run.stats()["replays"] >= 4 and run.stats()["steps_followed"] >= 4, run.stats()


def _dropout_and_randn(x, w):
    h = torch.nn.functional.dropout(x @ w, 0.5)
    return h + torch.randn(h.shape, device=h.device)


def _calls_draw_as_eager(run, remote, seeds):
    """``run`` (``_dropout_and_randn`` replayable) called under each seed gives eager's
    numbers, and leaves the generator where eager leaves it (the next local draws)."""
    torch.manual_seed(0)
    w = torch.randn(8, 8)
    rw = w.to(remote)
    for seed in seeds:
        x = torch.randn(4, 8)
        torch.manual_seed(seed)
        want = (_dropout_and_randn(x, w), torch.rand(2))
        torch.manual_seed(seed)
        got = (run(x.to(remote), rw).cpu(), torch.rand(2))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), seed


def test_random_ops_replay_drawing_what_eager_draws(remote):
    """Note [replayed draws]: dropout and ``randn`` in a replayed call, with the generator
    reseeded between calls and read by local draws between them: every call gives eager's
    numbers, including the replays, which draw anew. A sampler that draws as many numbers
    as its inputs' values say runs as it is."""
    run = djinn.replayable(_dropout_and_randn)
    threads = torch.get_num_threads()
    _calls_draw_as_eager(run, remote, (1, 2, 1, 3, 3, 4))
    assert run.stats()["replays"] == 4 and run.stats()["plain"] == {}, run.stats()
    # the draws ran on one thread (Note [scratch draws on one thread]), and gave it back
    assert torch.get_num_threads() == threads

    poisson = djinn.replayable(lambda rate: torch.poisson(rate))
    rate = torch.full((3,), 4.0).to(remote)
    for _ in range(4):
        poisson(rate).cpu()
    assert poisson.stats()["replays"] == 0
    assert "it read a value or captured nothing" in poisson.stats()["plain"]


@pytest.mark.parametrize(
    "local",
    [
        lambda: torch.manual_seed(123),
        lambda: torch.rand(5),
        lambda: torch.set_rng_state(torch.get_rng_state()) or torch.rand(1),
    ],
    ids=["a seed", "a local draw", "a state set"],
)
def test_a_call_that_uses_the_local_generator_itself_runs_as_it_is(remote, local):
    """Note [replayed draws]: a replay makes only its random ops' draws; a call that also
    seeds, restores or draws from the local generator itself runs as it is, with eager's
    numbers (a review found such calls replayed off eager from their third call)."""

    def fn(x):
        h = torch.nn.functional.dropout(x, 0.5)
        local()
        return torch.nn.functional.dropout(h, 0.5)

    run = djinn.replayable(fn)
    torch.manual_seed(0)
    xs = [torch.randn(16) for _ in range(5)]
    torch.manual_seed(1)
    want = [fn(x) for x in xs] + [torch.rand(3)]
    torch.manual_seed(1)
    got = [run(x.to(remote)).cpu() for x in xs] + [torch.rand(3)]
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    stats = run.stats()
    assert stats["replays"] == 0, stats
    assert "it uses the local random generator itself (a seed, a local draw)" in stats["plain"]


def test_a_sampler_of_an_expanded_rate_draws_eagers_numbers(remote):
    """Note [seeded ops]: a sampler that draws by its input's values reads them into a
    local copy of the input's layout; an expanded rate has none that can be written (copy_
    refused it, so eager's ``torch.poisson(rate.expand(...))`` raised on the remote
    device). Its values now go in as read, in the same order."""
    rate = torch.tensor([[3.0], [7.0]])
    torch.manual_seed(2)
    want, want_after = torch.poisson(rate.expand(2, 5)), torch.rand(3)
    torch.manual_seed(2)
    got = torch.poisson(rate.to(remote).expand(2, 5)).cpu()
    assert torch.equal(got, want) and torch.equal(torch.rand(3), want_after)


def test_a_recording_checks_its_draws_without_setting_the_generator_back(remote, monkeypatch):
    """Note [replayed draws]: a recording checks that a call drew only through its random
    ops by drawing them again on a private generator (dropout as its CPU kernel draws its
    mask, ``randn`` by its overload that takes a generator): the program's generator is
    never set back, so another thread's draws meanwhile are not lost."""
    from djinn.frontend import seeded

    checked, sets, inside = [], [], []
    real_check, real_set = seeded.drawn_alone, torch.set_rng_state

    def check(*args):
        inside.append(True)
        try:
            checked.append(real_check(*args))
            return checked[-1]
        finally:
            inside.pop()

    def set_state(state):
        if inside:
            sets.append(state)
        real_set(state)

    monkeypatch.setattr(seeded, "drawn_alone", check)
    monkeypatch.setattr(torch, "set_rng_state", set_state)
    run = djinn.replayable(_dropout_and_randn)
    _calls_draw_as_eager(run, remote, (1, 2, 3, 4))
    assert checked and all(checked) and not sets, (checked, len(sets))
    assert run.stats()["replays"] >= 1, run.stats()
