"""Note [writes another thread captured] (djinn/frontend/writes.py): an op captured on one
thread that writes into a tensor bound to a handle leaves the write pending in that
thread's trace; a read of the tensor on another thread sends it first, so the value read
is eager's, whether the writing thread is still capturing or has ended."""

from __future__ import annotations

import copy
import threading

import torch

import djinn
from djinn.frontend import trace


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def _train(model: torch.nn.Module, device: str, steps: int, replay: bool = False) -> None:
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    run = djinn.replayable(step) if replay else step
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 2, generator=gen)
        run(x.to(device), y.to(device))


def _on_a_thread(model: torch.nn.Module, device: str, replay: bool) -> list:
    """Train on a thread that ends without reading anything; its trace's pending ops."""
    left: list = []

    def work() -> None:
        _train(model, device, 6, replay)
        left.extend(trace.current().nodes)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    return left


def test_a_model_trained_on_a_thread_reads_as_eager_on_another(remote):
    """The thread's last optimizer step writes into the parameters (bound to their
    handles) and is still pending when the thread ends: the main thread's read sends it
    first. (Before, every parameter read one Adam step behind, 4e-3 to 1e-2 off.)"""
    local = _mlp()
    model = copy.deepcopy(local).to(remote)
    _train(local, "cpu", 6)
    left = _on_a_thread(model, remote, replay=False)
    assert left, "the thread's last step should still be pending when it ends"
    for p, q in zip(model.parameters(), local.parameters(), strict=True):
        assert torch.equal(p.detach().cpu(), q.detach())


def test_a_replay_on_another_thread_reads_what_a_thread_wrote(remote):
    """A replay reads its inputs by handle: one whose write another thread still holds
    is sent first, so the replayed call computes on eager's values."""
    local = _mlp()
    model = copy.deepcopy(local).to(remote)
    _train(local, "cpu", 6)
    _on_a_thread(model, remote, replay=False)
    forward = djinn.replayable(lambda x: model(x))
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(5))
    want = local(x).detach()
    for _ in range(4):  # recorded twice, then replayed
        got = forward(x.to(remote)).cpu()
        assert torch.equal(got, want)


def test_a_write_into_a_view_is_sent_before_its_base_is_read(remote):
    """A view's write goes into its base: a read of the base on another thread sends it."""
    base = torch.zeros(4, 4).to(remote)
    done = threading.Event()

    def work() -> None:
        base[1].add_(2.0)  # a write into a view of a tensor bound to a handle
        done.set()

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert done.is_set()
    want = torch.zeros(4, 4)
    want[1] += 2.0
    assert torch.equal(base.cpu(), want)


def _on_thread(work) -> None:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as exc:  # the assertion below names it
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert not errors, errors


def test_a_view_with_a_handle_of_its_own_reads_a_write_into_its_base(remote):
    """A view read back has a handle of its own that shares its base's storage: a write
    into the base on a thread is sent before the view is read on another."""
    base = torch.zeros(4, 4).to(remote)
    view = base[1]
    view.cpu()  # its own handle now
    _on_thread(lambda: base.add_(1.0))
    assert torch.equal(view.cpu(), torch.ones(4))


def test_a_write_into_one_view_is_sent_before_a_sibling_view_is_read(remote):
    base = torch.zeros(4, 4).to(remote)
    rows, row = base[1:3], base[1]
    rows.cpu(), row.cpu()  # each with a handle of its own
    _on_thread(lambda: row.add_(2.0))
    want = torch.zeros(2, 4)
    want[0] += 2.0
    assert torch.equal(rows.cpu(), want)
    # and a view of a view, made on the main thread before the write
    cell = base[2:4][0]
    _on_thread(lambda: base[2].fill_(5.0))
    assert torch.equal(cell.cpu(), torch.full((4,), 5.0))


def test_a_foreach_write_into_views_is_sent_before_their_base_is_read(remote):
    """The optimizers' ``_foreach_*`` lists are not looked at for ``_base`` (a read per
    element per step); a write through them into views still marks the storage."""
    base = torch.zeros(2, 3).to(remote)
    base.cpu()
    views = [base[0], base[1]]
    _on_thread(lambda: torch._foreach_add_(views, 1.0))
    assert torch.equal(base.cpu(), torch.ones(2, 3))


def test_a_read_on_another_thread_while_a_call_records_leaves_it_replayable(remote):
    """A thread reading a parameter while the trainer's replayable call records (after
    its step is captured, before the call returns) does not send the recording's graph
    in pieces, so the call still replays (a review: a thread polling a parameter every ms
    left a trainer with 0 replays in 100 calls); after the loop the parameters are
    eager's."""
    local = _mlp()
    model = copy.deepcopy(local).to(remote)
    _train(local, "cpu", 8)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    go, done = threading.Event(), threading.Event()

    def reader() -> None:
        while go.wait(timeout=30):
            go.clear()
            model[0].weight.detach().cpu()  # a handle the recording has a write into
            done.set()

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        go.set()  # read on the other thread now, while this call records
        assert done.wait(timeout=30)
        done.clear()

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    run = djinn.replayable(step)
    gen = torch.Generator().manual_seed(1)
    for _ in range(8):
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 2, generator=gen)
        run(x.to(remote), y.to(remote))
    for p, q in zip(model.parameters(), local.parameters(), strict=True):
        assert torch.equal(p.detach().cpu(), q.detach())
    assert run.stats()["replays"] >= 4, run.stats()


def test_a_view_a_replay_returns_shares_its_arguments_storage(remote):
    """A replayed call returning a view of its argument: a write into either on a thread
    is sent before the other is read (the replay's output was a new tensor sharing no
    mark with the argument: stale from the first replay on)."""
    base = torch.zeros(3, 4).to(remote)
    row = djinn.replayable(lambda t: t[1])
    for i in range(5):  # recorded twice, then replayed
        out = row(base)
        out.cpu()
        _on_thread(lambda: base.add_(1.0))
        assert torch.equal(out.cpu(), torch.full((4,), 2.0 * i + 1)), i
        _on_thread(lambda out=out: out.add_(1.0))
        assert torch.equal(base.cpu()[1], torch.full((4,), 2.0 * i + 2)), i
    assert row.stats()["replays"] == 3, row.stats()


WRITES_ON_ANOTHER_THREAD = {
    "into a view": lambda u: u[0].fill_(0),
    "in place": lambda u: u.mul_(0),
    "copied into": lambda u: u.copy_(torch.zeros(4)),
    "into a base's view": lambda u: u.view(2, 2)[0].zero_(),
}


def test_an_op_captured_before_another_threads_write_reads_the_value_before_it(remote):
    """Note [reads another thread captured] (writes.py), a review's case: ``t = u + 1``
    pending on this thread, then another thread writes ``u`` and reads; the write went
    first, and ``t`` came back with it in. Eager's ``t`` is from before the write."""
    for name, write in WRITES_ON_ANOTHER_THREAD.items():
        u = torch.ones(4).to(remote)
        view = u[1:]
        t = u + 1  # pending in this thread's trace
        s = view * 3  # and one taking a view of it
        seen: list = []
        _on_thread(lambda: (write(u), seen.append(u.cpu())))  # noqa: B023
        assert torch.equal(t.cpu(), torch.full((4,), 2.0)), name
        assert torch.equal(s.cpu(), torch.full((3,), 3.0)), name
        assert seen[0].sum() < 4, name  # the write itself went


def test_a_write_captured_after_another_threads_write_lands_last(remote):
    """Two threads write the same tensor: the pending one captured first runs first."""
    u = torch.zeros(3).to(remote)
    u.fill_(1.0)  # pending here
    _on_thread(lambda: (u.fill_(2.0), u.cpu()))
    assert torch.equal(u.cpu(), torch.full((3,), 2.0))
