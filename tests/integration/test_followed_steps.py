"""Note [followed steps] (djinn/frontend/replay_follow.py): a replayed training call whose
optimizer steps' floats change at every call (the default Adam's) follows its steps into
one request; steps that part from the recording's are captured as they were called, and
every parameter, gradient and state ends as local eager's."""

from __future__ import annotations

import contextlib
import cProfile

import pytest
import torch

import djinn
from djinn.frontend import inflight
from djinn.frontend.session import default_session
from djinn.runtime import flights
from tests.integration.test_replayable_training import _batches, _encoder, _moved


class Decaying(torch.optim.Optimizer):
    """SGD whose step size is ``lr / k`` at its k-th step: a Python float that changes
    at every step, as Adam's bias corrections do. ``extra``: every third step also
    scales each parameter (an op the recording did not make); ``detach``: reads each
    gradient through ``detach()``; ``keep``: every third step keeps its last update in
    ``self.kept``; ``fail_at``: that step raises once its updates are made; ``read``:
    every third step reads its updates' values (``tolist``)."""

    def __init__(self, params, *, extra=False, detach=False, keep=False, fail_at=0, read=False):
        super().__init__(params, {"lr": 0.05})
        self.k = 0
        self.extra, self.detach, self.keep, self.fail_at = extra, detach, keep, fail_at
        self.read, self.seen = read, []
        self.kept = None

    @torch.no_grad()
    def step(self, closure=None):
        self.k += 1
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad.detach() if self.detach else p.grad
                update = grad * (group["lr"] / self.k)  # a new tensor: its own op
                p.sub_(update)
                if self.extra and self.k % 3 == 0:
                    p.mul_(0.999)
                if self.keep and self.k % 3 == 0:
                    self.kept = update
                if self.read and self.k % 3 == 0:
                    self.seen.append(update.tolist())  # a value it made, read at once
        if self.k == self.fail_at:
            raise RuntimeError(f"step {self.k} failed")


@pytest.fixture
def sent(monkeypatch):
    """One entry per graph the session sends without waiting: its template form (a
    replay), or None (a flush)."""
    sent = []
    real = flights.Flights.run_graph_async
    monkeypatch.setattr(
        flights.Flights,
        "run_graph_async",
        lambda self, *a, **k: sent.append(k.get("form")) or real(self, *a, **k),
    )
    return sent


def _step_of(model, opt):
    """The training step every test here replays."""

    def step(x, y):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def _loop(model, make_opt, device, replay, n=8):
    """``n`` training steps; their losses (None for a step that raised), the Replayable
    (or the step) and the optimizer."""
    opt = make_opt(model.parameters())
    step = _step_of(model, opt)
    run = djinn.replayable(step) if replay else step
    losses = []
    for x, y in _batches(device, n):
        try:
            losses.append(run(x, y))
        except RuntimeError as exc:
            assert "failed" in str(exc)
            losses.append(None)
    return losses, run, opt


def _both(remote, make_opt, n=8):
    """The loop on local eager and replayed on ``remote`` from the same weights: the same
    bits in every loss, parameter and gradient. (remote Replayable, local and remote
    optimizers.)"""
    local = _encoder()
    model = _moved(local, remote)
    want, _, local_opt = _loop(local, make_opt, "cpu", False, n)
    got, run, opt = _loop(model, make_opt, remote, True, n)
    for g, w in zip(got, want, strict=True):
        assert (g is None) == (w is None)
        assert g is None or torch.equal(g.cpu(), w)
    for p, q in zip(model.parameters(), local.parameters(), strict=True):
        assert torch.equal(p.detach().cpu(), q.detach())
        assert torch.equal(p.grad.cpu(), q.grad)
    return run, local_opt, opt


def test_a_default_adam_step_is_followed_into_a_template_of_its_own(ahead, remote, sent):
    """Each replay after the recordings sends the ops before the steps at once, then the
    steps' own graph with this step's bias corrections, both by fingerprint (the appliance
    made the steps' template what the client did); or the whole recording once the steps
    were followed. No op of the step is captured."""
    run, local_opt, opt = _both(remote, lambda ps: torch.optim.Adam(ps, lr=1e-2), n=9)
    stats = run.stats()
    assert stats["replays"] == 6 and stats["steps_followed"] == 6, stats
    assert stats["steps_captured"] == {}, stats
    pairs = zip(opt.param_groups[0]["params"], local_opt.param_groups[0]["params"], strict=True)
    for p, q in pairs:
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][key].cpu(), local_opt.state[q][key])
        assert torch.equal(opt.state[p]["step"], local_opt.state[q]["step"])
    sent.clear()
    for x, y in _batches(remote, 3):
        run(x, y)
    inflight.land_all()
    fps = [form[0] for form in sent if form is not None]
    a_step = 2 if ahead else 1
    assert len(sent) == len(fps) == 3 * a_step, sent
    assert len(set(fps)) == a_step and set(fps) <= default_session()._graphs, sent


def test_a_step_that_makes_another_op_is_captured_from_there(ahead, remote):
    """Every third step scales the parameters too: its following stops at that op, the
    ops followed before it are captured as they were called, then the rest."""
    run, _, _ = _both(remote, lambda ps: Decaying(ps, extra=True), n=9)
    stats = run.stats()
    assert stats["steps_followed"] >= 3, stats
    assert sum(stats["steps_captured"].values()) >= 2, stats
    assert any("mul_" in why for why in stats["steps_captured"]), stats


def test_a_step_that_detaches_is_captured(ahead, remote):
    """``detach`` is not followed: each step is captured, with eager's bits."""
    run, _, _ = _both(remote, lambda ps: Decaying(ps, detach=True))
    stats = run.stats()
    assert stats["replays"] >= 4 and stats["steps_followed"] == 0, stats
    assert any("detach" in why for why in stats["steps_captured"]), stats


def test_a_tensor_a_step_keeps_holds_what_it_made(ahead, remote):
    """A step that keeps a tensor it made (``self.kept``) is captured once it ran, and
    that tensor is bound to the value the capture made."""
    run, local_opt, opt = _both(remote, lambda ps: Decaying(ps, keep=True))
    assert torch.equal(opt.kept.cpu(), local_opt.kept)
    stats = run.stats()
    assert stats["steps_captured"].get("a tensor its steps made outlives them", 0) >= 1, stats
    assert stats["steps_followed"] >= 2, stats


def test_a_step_that_raises_leaves_what_eager_leaves(ahead, remote):
    """A step raising after its updates: the error reaches the program, the updates
    made before it are not lost, and the loop goes on."""
    run, _, _ = _both(remote, lambda ps: Decaying(ps, fail_at=5))
    assert run.stats()["steps_captured"].get("a step raised") == 1, run.stats()


def test_a_step_that_reads_a_value_it_made_reads_eagers(ahead, remote):
    """Every third step reads the update it just made (``tolist``, which reads without an
    op): the following stops there, the update is captured, and the value read is
    eager's."""
    run, local_opt, opt = _both(remote, lambda ps: Decaying(ps, read=True), n=9)
    assert opt.seen == local_opt.seen and len(opt.seen) == 3 * len(
        list(opt.param_groups[0]["params"])
    )
    stats = run.stats()
    assert stats["steps_followed"] >= 3 and stats["steps_captured"], stats


def test_an_optimizer_state_loaded_mid_loop_is_freed_and_followed_again(ahead, remote):
    """``load_state_dict`` replaces Adam's state: the old state is freed as eager frees it
    (a review found the whole recording holding it), the call records again, and its
    steps are followed again from the new state, with eager's bits."""
    import copy
    import gc
    import weakref

    local = _encoder()
    model = _moved(local, remote)
    runs = []
    for m, device in ((local, "cpu"), (model, remote)):
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        step = _step_of(m, opt)
        run = djinn.replayable(step) if device == remote else step
        batches = _batches(device, 12)
        for x, y in batches[:6]:
            run(x, y)
        old = [weakref.ref(opt.state[p]["exp_avg"]) for p in m.parameters()]
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        gc.collect()
        assert not any(w() is not None for w in old)
        for x, y in batches[6:]:
            run(x, y)
        runs.append((m, opt, run))
    (_, local_opt, _), (_, opt, run) = runs
    for p, q in zip(model.parameters(), local.parameters(), strict=True):
        assert torch.equal(p.detach().cpu(), q.detach())
    for p, q in zip(opt.param_groups[0]["params"], local_opt.param_groups[0]["params"],
                    strict=True):  # fmt: skip
        assert torch.equal(opt.state[p]["exp_avg_sq"].cpu(), local_opt.state[q]["exp_avg_sq"])
    stats = run.stats()
    assert stats["steps_followed"] >= 6 and stats["steps_captured"] == {}, stats


def test_follow_false_captures_the_steps_at_every_replay(remote, sent):
    """``djinn.replayable(fn, follow=False)``: the steps are captured at every replay,
    two graphs a call, with the same bits; a follow that is not a bool is refused."""
    local = _encoder()
    model = _moved(local, remote)
    want, _, _ = _loop(local, lambda ps: torch.optim.Adam(ps, lr=1e-2), "cpu", False, 9)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    run = djinn.replayable(_step_of(model, opt), follow=False)
    got = [run(x, y) for x, y in _batches(remote, 9)]
    assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want, strict=True))
    for p, q in zip(model.parameters(), local.parameters(), strict=True):
        assert torch.equal(p.detach().cpu(), q.detach())
    stats = run.stats()
    assert stats["replays"] == 6 and stats["steps_followed"] == 0, stats
    sent.clear()
    for x, y in _batches(remote, 3):
        run(x, y)
    # the ops before the steps, a replay, then the steps, captured
    assert [form is not None for form in sent] == [True, False] * 3, sent
    with pytest.raises(TypeError, match="follow"):
        djinn.replayable(_step_of(model, opt), follow="no")


class Lookahead:
    """A wrapper around an optimizer that does not start as one (as
    ``torch_optimizer.Lookahead`` does not): PyTorch's step hooks see only the inner
    step, and every ``k``-th step of its own pulls slow weights towards the parameters
    and copies them back, Python a replay calling the inner ``step()`` would skip."""

    def __init__(self, inner, k=3, alpha=0.5):
        self.inner, self.k, self.alpha, self.n, self.slow = inner, k, alpha, 0, None
        self.param_groups = inner.param_groups

    @torch.no_grad()
    def step(self):
        self.inner.step()
        self.n += 1
        params = [p for group in self.param_groups for p in group["params"]]
        if self.slow is None:
            self.slow = [p.detach().clone() for p in params]
        if self.n % self.k == 0:
            for slow, p in zip(self.slow, params, strict=True):
                slow.add_(p - slow, alpha=self.alpha)
                p.copy_(slow)

    def zero_grad(self):
        self.inner.zero_grad()


@pytest.mark.parametrize(
    "inner",
    [
        lambda ps: torch.optim.Adam(ps, lr=1e-2),  # its steps would be followed
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),  # it would replay whole
    ],
    ids=["adam", "sgd"],
)
def test_a_step_called_by_a_wrapper_is_not_replayed(remote, inner):
    """Note [steps a replay would skip] (replay_key.py): a replay would run the inner
    optimizer's step and not the wrapper's Python (before, a Lookahead around Adam ended
    with wrong parameters and no error). The call is captured every time, with eager's
    bits, and ``stats()`` says why."""
    run, _, _ = _both(remote, lambda ps: Lookahead(inner(ps)), n=9)
    stats = run.stats()
    assert stats["replays"] == 0, stats
    assert any("Lookahead.step" in why for why in stats["plain"]), stats


class LookaheadOptimizer(torch.optim.Optimizer):
    """The same wrapper started as an ``Optimizer``: PyTorch's hooks see its step, and
    its count is a plain attribute a whole replay would freeze."""

    def __init__(self, inner, k=3, alpha=0.5):
        super().__init__(inner.param_groups[0]["params"], {"lr": 0.0})
        self.inner, self.k, self.alpha, self.n, self.slow = inner, k, alpha, 0, None

    step = Lookahead.step

    def zero_grad(self, set_to_none=True):
        self.inner.zero_grad(set_to_none)


def test_a_wrapper_started_as_an_optimizer_keeps_its_count(remote):
    """Around SGD, whose recordings are alike as wholes, a whole replay skipped the
    wrapper's count (a review: wrong outputs from the seventh call on). Its count is
    what the optimizer keeps, so its ``step()`` runs at each call: eager's bits."""
    run, _, _ = _both(
        remote, lambda ps: LookaheadOptimizer(torch.optim.SGD(ps, lr=0.05, momentum=0.9)), n=9
    )
    assert run.stats()["replays"] == 0, run.stats()


@pytest.mark.parametrize("profiled", [False, True], ids=["alone", "under cProfile"])
def test_a_scheduler_stepped_inside_fn_is_not_replayed(remote, profiled):
    """A ``StepLR`` stepped in the call keeps one learning rate for three calls, so the
    recordings agreed and a replay never stepped it (a review: parameters 5.8e-3 off).
    The call runs as it is, with eager's bits; ``stats()`` names the scheduler. Under
    cProfile, which holds the profile hook, the trace hook sees the step."""

    def step_of(m, opt):
        schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)

        def step(x, y):
            opt.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            opt.step()
            schedule.step()

        return step

    profiler = cProfile.Profile() if profiled else contextlib.nullcontext()
    with profiler:
        stats = _local_and_replayed(remote, step_of, 9)
    assert any("StepLR.step" in why for why in stats["plain"]), stats


class Trainer:
    """A training step as a method, its step in a helper method: ``fn``'s own Python."""

    def __init__(self, model, opt):
        self.model, self.opt = model, opt

    def train_step(self, x, y):
        self.opt.zero_grad()
        torch.nn.functional.mse_loss(self.model(x), y).backward()
        self.step()

    def step(self):  # named as an optimizer's, but the trainer's own
        self.opt.step()


def test_a_step_in_a_method_of_the_caller_is_followed(remote):
    """``fn`` a bound method whose helper method steps: still followed (the first
    version of this check refused every method between ``fn`` and the step)."""
    local = _encoder()
    model = _moved(local, remote)
    trainers = [Trainer(m, torch.optim.Adam(m.parameters(), lr=1e-2)) for m in (local, model)]
    run = djinn.replayable(trainers[1].train_step)
    for (x, y), (rx, ry) in zip(_batches("cpu", 8), _batches(remote, 8), strict=True):
        trainers[0].train_step(x, y)
        run(rx, ry)
    for p, q in zip(model.parameters(), local.parameters(), strict=True):
        assert torch.equal(p.detach().cpu(), q.detach())
    assert run.stats()["steps_followed"] >= 5, run.stats()


def test_a_step_called_by_a_plain_function_is_followed(remote):
    """A plain function between ``fn`` and the step is ``fn``'s own Python (which a
    replay never runs): the steps are still followed, with eager's bits."""

    def apply(opt):
        opt.step()

    def step_of(model, opt):
        def step(x, y):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            apply(opt)

        return step

    stats = _local_and_replayed(remote, step_of, 8)
    assert stats["steps_followed"] >= 5, stats


def _local_and_replayed(remote, step_of, n):
    """``n`` calls of ``step_of(model, Adam)`` on local eager and replayed on ``remote``
    from the same weights, their parameters equal bit for bit; the replay's stats."""
    local = _encoder()
    model = _moved(local, remote)
    for m, device, replay in ((local, "cpu", False), (model, remote, True)):
        run = step_of(m, torch.optim.Adam(m.parameters(), lr=1e-2))
        run = djinn.replayable(run) if replay else run
        for x, y in _batches(device, n):
            run(x, y)
    for p, q in zip(model.parameters(), local.parameters(), strict=True):
        assert torch.equal(p.detach().cpu(), q.detach())
    return run.stats()


def _embedding_loop(remote, hook=None):
    """An embedding model trained by a replayed default-Adam step (``hook``: a step
    pre-hook of its optimizer), five calls in, its steps followed: (model, optimizer,
    Replayable, good ids, target)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(6, 4), torch.nn.Linear(4, 1)).to(remote)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    if hook is not None:
        opt.register_step_pre_hook(hook)

    def step(idx, y):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(idx).sum(1), y)
        loss.backward()
        opt.step()
        return loss.detach()

    run = djinn.replayable(step)
    good, y = torch.tensor([[0, 5], [2, 3]]).to(remote), torch.ones(2, 1).to(remote)
    for _ in range(5):
        run(good, y)
    return model, opt, run, good, y


def test_a_followed_step_whose_forward_fails_leaves_what_it_writes_failed(ahead, remote):
    """The ops before the steps fail on the appliance (an index out of range, seen by the
    kernel only) while the steps are followed: the steps are not sent, and the loss, the
    parameters and Adam's state raise the error when read, as a replay that fails leaves
    what it writes (Note [failed values]); the table of indices it only reads is intact."""
    from djinn.errors import DjinnError

    model, opt, run, _good, y = _embedding_loop(remote)
    assert run.stats()["steps_followed"] >= 2, run.stats()
    bad = torch.tensor([[0, 9], [2, 3]]).to(remote)  # row 9 of 6
    try:
        loss = run(bad, y)
    except DjinnError as exc:  # raised where the replay lands, inside the call
        assert "index" in str(exc)
    else:
        with pytest.raises(DjinnError, match="index"):
            loss.cpu()
    weight = model[1].weight
    with pytest.raises(DjinnError, match="index"):
        weight.cpu()
    with pytest.raises(DjinnError, match="index"):
        opt.state[weight]["exp_avg"].cpu()
    assert torch.equal(bad.cpu(), torch.tensor([[0, 9], [2, 3]]))


def test_a_loop_whose_forward_failed_lets_its_handles_go_once_dropped(ahead, appliance, remote):
    """Note [raising a kept error]: the loop above, its failed values read (each raises),
    then dropped: the appliance holds none of its tensors any more. The error kept on the
    failed values had gathered every reader's frames, the loop's model and optimizer
    among their locals, in a cycle through tensors C++ holds, which Python's collector
    never freed: 12 handles stayed on the appliance for good."""

    from djinn.errors import DjinnError
    from tests.caught_failures import session_handles
    from tests.conftest import wait_for

    s = default_session()

    def handles() -> int:
        return session_handles(appliance, s)

    before = handles()

    def failed_loop() -> None:
        model, opt, run, good, y = _embedding_loop(remote)
        with contextlib.suppress(DjinnError):
            run(torch.tensor([[0, 9], [2, 3]]).to(remote), y).cpu()  # row 9 of 6
        weight = model[1].weight
        for value in (weight, weight.grad, opt.state[weight]["exp_avg"]):
            with pytest.raises(DjinnError, match="index"):
                value.cpu()
        with pytest.raises(DjinnError, match="index"):  # it reads the failed parameters
            run(good, y).cpu()

    failed_loop()
    wait_for(lambda: handles() <= before, timeout=10)


def test_a_cpu_worker_says_how_many_threads_a_graph_sent_without_waiting_gets(remote):
    """The session-open reply of a CPU worker carries ``cpu_threads``."""
    s = default_session()
    assert s.device.startswith("cpu")
    assert isinstance(s.cpu_threads, int) and s.cpu_threads >= 1


def test_a_failed_forward_landed_by_another_thread_leaves_what_the_steps_write_failed(
    ahead, remote
):
    """As above, but another thread reads an unrelated value as the step starts, which
    lands the part before the steps when it went ahead: the call raises, and Adam's
    moments and the parameters hold the error. (A review found them readable with their
    old values while the step counts had gone on: a loop that caught the error trained on
    8e-4 off eager, silently.)"""
    import threading

    from djinn.errors import DjinnError

    other = torch.ones(3).to(remote) * 2
    reading = {"on": False, "read": []}

    def read(out):
        try:
            out.append((other + 1).cpu())
        except DjinnError as exc:  # it landed the failed replay: raised where it lands
            out.append(exc)

    def read_elsewhere(_opt, _args, _kwargs):
        if reading["on"]:
            t = threading.Thread(target=read, args=(reading["read"],))
            t.start()
            t.join()

    model, opt, run, _good, y = _embedding_loop(remote, read_elsewhere)
    assert run.stats()["steps_followed"] >= 2, run.stats()
    reading["on"] = True
    with pytest.raises(DjinnError, match="index"):
        run(torch.tensor([[0, 9], [2, 3]]).to(remote), y).cpu()
    (got,) = reading["read"]
    assert isinstance(got, DjinnError) or torch.equal(got, torch.full((3,), 3.0)), got
    weight = model[1].weight
    for t in (weight, opt.state[weight]["exp_avg"]):
        with pytest.raises(DjinnError, match="index"):
            t.cpu()
