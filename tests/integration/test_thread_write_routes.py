"""Note [reads another thread captured] (djinn/frontend/writes.py) on every route a write
takes: an op run at once (a fused optimizer's step), a replay's write, a followed step;
reads of a value still pending on another thread or in flight; the window in which a
thread has taken its ops and not sent them. And Note [failures raised on their thread]
(failures.py): a graph another thread sent fails on the thread that captured it.

Each case was a wrong number found by a review (2026-11-28), compared with eager on the
CPU; the expected values below are eager's."""

from __future__ import annotations

import queue
import sys
import threading

import pytest
import torch

import djinn
from djinn.errors import ExecutionError
from djinn.frontend import trace


def _on_thread(fn) -> list:
    """Run ``fn`` on a thread and wait for it; what it returned, or raised, in a list."""
    out: list = []

    def body() -> None:
        try:
            out.append(fn())
        except Exception as exc:  # the test looks at it
            out.append(exc)

    th = threading.Thread(target=body)
    th.start()
    th.join()
    return out


def test_a_read_of_another_threads_pending_value_runs_before_its_write(remote):
    """``u`` is made, pending, on thread B; this thread captures ``t = u + 1`` (which sends
    B's trace: ``u`` still has no handle to mark); B then writes ``u``. ``t`` read the
    write before (``[1, 1, 1, 1]``)."""
    go, made = queue.Queue(), queue.Queue()
    box: dict = {}

    def b() -> None:
        u = torch.ones(4, device=remote) * 1.0
        box["u"] = u
        made.put(1)
        go.get()
        u.mul_(0)
        box["seen"] = u.cpu()

    th = threading.Thread(target=b)
    th.start()
    made.get()
    t = box["u"] + 1
    go.put(1)
    th.join()
    assert torch.equal(box["seen"], torch.zeros(4))
    assert torch.equal(t.cpu(), torch.full((4,), 2.0))


def test_a_read_of_this_threads_value_in_flight_runs_before_another_threads_write(remote):
    """``u`` is pending here; B's read sends it without waiting, and this thread takes
    ``u`` while it is in flight; B then writes it."""
    u = torch.ones(4, device=remote) * 1.0
    sent = _on_thread(lambda: u.sum())  # captures on B: sends this thread's graph
    t = u + 1
    seen = _on_thread(lambda: (u.mul_(0), u.cpu())[1])
    assert torch.equal(seen[0], torch.zeros(4))
    assert torch.equal(t.cpu(), torch.full((4,), 2.0))
    assert sent[0].item() == 4.0


def test_a_replays_write_runs_after_another_threads_earlier_read(remote):
    """B writes ``u`` through a replay of a replayable function; this thread captured
    ``t = u + 1`` before (``[1.5, ...]`` before the fix)."""

    @djinn.replayable
    def scale(x: torch.Tensor) -> None:
        x.mul_(0.5)

    w = torch.ones(4, device=remote)
    for _ in range(4):
        scale(w)
    u = torch.ones(4).to(remote)
    t = u + 1
    seen = _on_thread(lambda: (scale(u), u.cpu())[1])
    assert scale.stats()["replays"] == 3, scale.stats()
    assert torch.equal(seen[0], torch.full((4,), 0.5))
    assert torch.equal(t.cpu(), torch.full((4,), 2.0))


def test_followed_steps_run_after_another_threads_earlier_read(remote):
    """A training step replayed on B, its optimizer steps followed (Note [followed
    steps]): what this thread captured from the parameters before each step reads them
    as they were."""
    torch.manual_seed(0)
    local = torch.nn.Linear(4, 2)
    model = torch.nn.Linear(4, 2)
    model.load_state_dict(local.state_dict())
    model = model.to(remote)

    def make_step(m: torch.nn.Module):
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)

        def step(x: torch.Tensor) -> None:
            opt.zero_grad()
            m(x).square().sum().backward()
            opt.step()

        return step

    step_local, step_remote = make_step(local), djinn.replayable(make_step(model))
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    xr = x.to(remote)
    for i in range(6):
        before = local.weight.detach() * 2
        taken = model.weight.detach() * 2  # pending here when B steps
        step_local(x)
        _on_thread(lambda: step_remote(xr))
        assert torch.allclose(taken.cpu(), before, atol=1e-6), i
    got, want = model.weight.detach().cpu(), local.weight.detach()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert step_remote.stats()["replays"] >= 3, step_remote.stats()


def test_a_fused_sgd_step_is_ordered_with_other_threads(remote):
    """``SGD(fused=True)`` runs at once (its op has no meta kernel) and recorded no write:
    a pending read here took the stepped value, and a step on a thread that ended without
    a read was not sent before this thread's read."""
    p = torch.nn.Parameter(torch.ones(4).to(remote))
    opt = torch.optim.SGD([p], lr=0.5, fused=True)
    t = p * 1

    def step() -> None:
        p.grad = torch.ones(4).to(remote)
        opt.step()

    _on_thread(lambda: (step(), p.detach().cpu())[1])
    assert torch.equal(t.cpu(), torch.ones(4))
    _on_thread(step)
    assert torch.equal(p.detach().cpu(), torch.zeros(4))


def test_a_write_in_the_window_a_reader_is_sending_waits_for_it(remote, monkeypatch):
    """This thread's flush has taken ``t = u + 1`` and is encoding it when B writes ``u``
    (forced by pausing the encoder): B's write waits for the graph to be sent."""
    u = torch.ones(4).to(remote)
    u.cpu()
    t = u + 1
    me = threading.get_ident()
    in_window, captured = threading.Event(), threading.Event()
    encode = trace._Encoder.node

    def node(self, n):
        if threading.get_ident() == me and not in_window.is_set():
            in_window.set()
            captured.wait(2)  # B's write, if it does not wait, is captured meanwhile
        return encode(self, n)

    monkeypatch.setattr(trace._Encoder, "node", node)
    seen: dict = {}

    def b() -> None:
        in_window.wait()
        threading.Timer(0.5, captured.set).start()  # B blocks in its write if it waits
        u.mul_(0)
        captured.set()
        seen["u"] = u.cpu()

    th = threading.Thread(target=b)
    th.start()
    got = t.cpu()
    th.join()
    assert torch.equal(got, torch.full((4,), 2.0))
    assert torch.equal(seen["u"], torch.zeros(4))


def test_an_inference_tensor_written_through_a_later_view_waits_for_its_readers(remote):
    """An inference tensor read whole (no view, so no shared mark yet), then written on B
    through a view made after: the mark made for the view knows the reader."""
    with torch.inference_mode():
        u = torch.arange(6.0).to(remote)
        u.cpu()
        t = u * 2

    def b():
        with torch.inference_mode():
            u.view(2, 3)[1].zero_()
        return u.cpu()

    seen = _on_thread(b)
    assert torch.equal(t.cpu(), torch.arange(6.0) * 2)
    assert seen[0].tolist() == [0.0, 1.0, 2.0, 0.0, 0.0, 0.0]


def test_a_failure_another_thread_sent_is_raised_on_the_thread_that_captured_it(remote):
    """This thread has ``t = u + 1`` and a singular ``linalg.inv`` pending; B writes ``u``,
    which sends them first. The inverse's check fails: B raised it, and this thread read
    the inverse's nan without an error. Now B goes on, and this thread raises it at its
    next read, as its own flush would have."""
    u = torch.ones(4).to(remote)
    z = torch.zeros(3, 3).to(remote)
    u.cpu(), z.cpu()
    t = u + 1
    torch.linalg.inv(z)  # pending; eager raises here

    seen = _on_thread(lambda: (u.mul_(0), u.cpu())[1])
    assert not isinstance(seen[0], Exception), seen
    assert torch.equal(seen[0], torch.zeros(4))
    with pytest.raises(ExecutionError, match=r"linalg\.inv"):
        t.cpu()
    assert torch.equal(t.cpu(), torch.full((4,), 2.0))  # raised once; the value stands


def test_a_failure_sent_by_another_threads_read_is_raised_on_the_thread_that_captured_it(
    remote,
):
    """The read direction (Note [writes another thread captured]): B reads ``u``, which
    sends this thread's pending write of it and its failing ``linalg.inv``."""
    u = torch.ones(4).to(remote)
    z = torch.zeros(3, 3).to(remote)
    u.cpu(), z.cpu()
    u.add_(1)
    torch.linalg.inv(z)
    seen = _on_thread(lambda: u.cpu())
    assert torch.equal(seen[0], torch.full((4,), 2.0))
    with pytest.raises(ExecutionError, match=r"linalg\.inv"):
        u.cpu()


def test_a_backward_pass_keeps_another_threads_failure_for_that_thread(remote):
    """B has ``t = u + 1`` and a singular ``inv`` pending; this thread writes ``u`` (which
    sends B's graph) and runs backward(), which lands it. backward() raised B's error, and
    B read ``t`` without one; eager raises in B, and this thread's backward works."""
    u = torch.ones(4).to(remote)
    z = torch.zeros(3, 3).to(remote)
    w = torch.ones(4).to(remote).requires_grad_()
    u.cpu(), z.cpu(), w.detach().cpu()
    ready, done = threading.Event(), threading.Event()
    seen: list = []

    def b() -> None:
        t = u + 1
        torch.linalg.inv(z)
        ready.set()
        done.wait(60)
        for _ in range(2):
            try:
                seen.append(t.cpu())
            except ExecutionError as exc:
                seen.append(exc)

    th = threading.Thread(target=b)
    th.start()
    ready.wait(60)
    u.mul_(0)
    (w * 2).sum().backward()
    done.set()
    th.join(60)
    assert torch.equal(w.grad.cpu(), torch.full((4,), 2.0))
    assert isinstance(seen[0], ExecutionError) and "linalg.inv" in str(seen[0]), seen
    assert torch.equal(seen[1], torch.full((4,), 2.0))


def test_a_thread_whose_first_remote_op_ran_in_a_cpu_backward_owns_its_trace(remote):
    """A gradient hook in a CPU backward pass moves the gradient to the remote device: the
    thread's trace was made inside a backward pass and owned by no thread, so its
    failures were raised wherever they landed (another thread's write raised them)."""
    seen: list = []

    def c() -> None:
        a = torch.ones(3, requires_grad=True)
        moved: list = []
        a.register_hook(lambda g: moved.append(g.to(remote) * 1))  # returns None
        (a * 2).sum().backward()  # on the CPU: runs on this thread
        u, z = torch.ones(4).to(remote), torch.zeros(3, 3).to(remote)
        u.cpu(), z.cpu()
        t = u + 1
        torch.linalg.inv(z)
        seen.extend(_on_thread(lambda: (u.mul_(0), u.cpu())[1]))
        try:
            t.cpu()
        except ExecutionError as exc:
            seen.append(exc)

    assert _on_thread(c) == [None], seen
    assert torch.equal(seen[0], torch.zeros(4)), seen
    assert isinstance(seen[1], ExecutionError) and "linalg.inv" in str(seen[1]), seen


def test_a_write_waits_for_a_reader_about_to_take_its_nodes(remote):
    """The window opens before the flush takes the nodes: a writer looking between the
    two saw neither nodes nor ``sending`` and went first (forced by a line trace that
    pauses this thread's flush right after it took them)."""
    u = torch.ones(4).to(remote)
    u.cpu()
    code = trace.flush.__code__
    with open(code.co_filename) as f:
        line = next(i for i, text in enumerate(f, 1) if "if not nodes and not fetch" in text)
    in_window, done = threading.Event(), threading.Event()
    seen: dict = {}

    def b() -> None:
        in_window.wait(30)
        threading.Timer(0.5, done.set).start()  # B blocks in its write if it waits
        u.mul_(0)
        seen["u"] = u.cpu()
        done.set()

    th = threading.Thread(target=b)
    th.start()
    t = u + 1

    def local(frame, event, arg):
        if event == "line" and frame.f_lineno == line and not in_window.is_set():
            in_window.set()
            done.wait(3)
        return local

    sys.settrace(lambda frame, event, arg: local if frame.f_code is code else None)
    try:
        got = t.cpu()
    finally:
        sys.settrace(None)
    th.join(30)
    assert torch.equal(got, torch.full((4,), 2.0))
    assert torch.equal(seen["u"], torch.zeros(4))


def test_a_kept_failure_read_from_its_value_is_not_raised_again(remote):
    """B has a singular ``inv`` and ``c = b * 3`` pending; this thread reads ``c``, which
    sends and lands B's graph: the check's error is kept for B, and B's inverse holds it
    too. B read the inverse (raised), and its next, unrelated read raised the same error
    a second time (a review); eager raises it once."""
    a = torch.zeros(2, 2).to(remote)
    b = torch.arange(3.0).to(remote)
    a.cpu(), b.cpu()
    box: dict = {}
    ready, done = threading.Event(), threading.Event()
    seen: list = []

    def thread_b() -> None:
        box["inv"] = torch.linalg.inv(a)
        box["c"] = b * 3
        ready.set()
        done.wait(60)
        for read in (lambda: box["inv"].cpu(), lambda: box["c"].cpu(), lambda: (b + 10).cpu()):
            try:
                seen.append(read())
            except ExecutionError as exc:
                seen.append(exc)

    th = threading.Thread(target=thread_b)
    th.start()
    ready.wait(60)
    assert torch.equal(box["c"].cpu(), torch.tensor([0.0, 3.0, 6.0]))  # lands B's graph
    done.set()
    th.join(60)
    assert isinstance(seen[0], ExecutionError) and "linalg.inv" in str(seen[0]), seen
    assert torch.equal(seen[1], torch.tensor([0.0, 3.0, 6.0])), seen
    assert torch.equal(seen[2], torch.tensor([10.0, 11.0, 12.0])), seen
