"""Note [replayable functions]: ``djinn.replayable(fn)`` runs a repeated call by its
graph template with no op captured, with the bits a capture gives, and runs ``fn`` as it
is whenever a replay could give anything else."""

from __future__ import annotations

import gc

import pytest
import torch

import djinn
from djinn.errors import DjinnError
from djinn.frontend import inflight, trace
from djinn.frontend.session import default_session
from djinn.protocol.frames import Kind


def _mlp(blocks: int = 1) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(16, 32)]
    for _ in range(blocks):
        layers += [torch.nn.GELU(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 32)]
    return torch.nn.Sequential(*layers, torch.nn.Linear(32, 4)).eval()


def _moved(model: torch.nn.Module, remote: str) -> torch.nn.Module:
    import copy

    return copy.deepcopy(model).to(remote)


def _bytes() -> int:
    """Bytes of the session's EXEC requests: a journal cut (Note [lineage truncation])
    that falls within a call reads back every live value, which is not the call's."""
    return default_session().channel.sent_by_kind[Kind.EXEC]


def test_replays_give_local_eagers_bits_and_send_the_graph_by_fingerprint(remote, monkeypatch):
    from djinn.frontend import lazy

    local = _mlp(blocks=8)
    model = _moved(local, remote)
    fwd = djinn.replayable(lambda x: model(x))
    sent, captured = [], []
    dispatch = lazy.dispatch
    monkeypatch.setattr(lazy, "dispatch", lambda *a: captured.append(1) or dispatch(*a))
    with torch.no_grad():
        for i in range(6):
            # Handles of earlier tests' garbage the collector finds ride with the next
            # request (a CI run counted 1,390 bytes where the other replays sent 1,231):
            # collected before the put, and not during the call, they are not counted
            gc.collect()
            x = torch.randn(8, 16)
            rx = x.to(remote)
            trace.flush(trace.current())
            before, ops = _bytes(), len(captured)
            gc.disable()
            try:
                out = fwd(rx)
            finally:
                gc.enable()
            sent.append(_bytes() - before)
            assert (len(captured) > ops) == (i < 2), i  # a replay captures no op
            assert not trace.current().nodes
            assert torch.equal(out.cpu(), local(x)), i
    stats = fwd.stats()
    assert stats["recordings"] == 2 and stats["replays"] == 4 and stats["plain"] == {}
    # the first graph goes whole; every later one by its template (a replay's bytes are
    # the same as a capture's: what it saves is the client's capture)
    assert max(sent[1:]) < sent[0] / 2, sent
    assert len(set(sent[2:])) == 1, sent


def test_a_replay_reads_weights_as_they_are_now(remote):
    local = _mlp()
    model = _moved(local, remote)
    fwd = djinn.replayable(lambda x: model(x))
    x = torch.randn(4, 16)
    rx = x.to(remote)
    with torch.no_grad():
        for _ in range(3):
            fwd(rx)
        assert fwd.stats()["replays"] == 1
        for p, q in zip(model.parameters(), local.parameters(), strict=True):
            p.mul_(0.5)  # in place (an optimizer's step): the same handle, a new value
            q.mul_(0.5)
        for _ in range(3):
            assert torch.equal(fwd(rx).cpu(), local(x))
        assert fwd.stats()["recordings"] == 2 and fwd.stats()["replays"] == 4
        fresh = torch.randn(32, 16)
        model[0].weight.data = fresh.to(remote)  # replaced: the key records again
        local[0].weight.data = fresh
        assert torch.equal(fwd(rx).cpu(), local(x))
        assert fwd.stats()["recordings"] == 3 and fwd.stats()["replays"] == 4
        assert "a module, optimizer or tensor it uses changed since" in fwd.stats()["plain"]


def test_a_tensor_only_garbage_holds_is_not_kept_by_the_call(remote):
    """Note [garbage that holds a tensor]: a reference cycle that holds a tensor the call
    made (a traceback's frames did, on an op's first capture) is garbage, not something
    the call keeps: the call records (it was run as it is, "it keeps a tensor it made")."""

    class Box:
        pass

    def fn(x):
        y = x * 2
        box = Box()
        box.me, box.y = box, y  # a cycle: freed only by the collector
        return y + 1

    f = djinn.replayable(fn)
    x = torch.randn(4, 4)
    rx = x.to(remote)
    gc.collect()
    gc.disable()
    try:
        out = f(rx)
    finally:
        gc.enable()
    assert torch.equal(out.cpu(), x * 2 + 1)
    assert f.stats()["recordings"] == 1 and f.stats()["plain"] == {}, f.stats()


def test_new_argument_kinds_record_again(remote):
    local = _mlp()
    model = _moved(local, remote)
    fwd = djinn.replayable(lambda x, scale: model(x) * scale)
    with torch.no_grad():
        for shape, scale in [((2, 16), 2), ((2, 16), 2), ((2, 16), 2), ((3, 16), 2), ((2, 16), 3)]:
            x = torch.randn(*shape)
            assert torch.equal(fwd(x.to(remote), scale).cpu(), local(x) * scale)
    stats = fwd.stats()
    assert stats["keys"] == 3 and stats["replays"] == 1 and stats["recordings"] == 4


def test_a_transformers_output_replays(remote):
    import copy

    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64)
    local = GPT2LMHeadModel(cfg).eval()
    # moved in training mode so it stays on the graph path, then eval
    model = copy.deepcopy(local).train().to(remote).eval()
    fwd = djinn.replayable(lambda ids: model(ids).logits)
    whole = djinn.replayable(lambda ids: model(ids))  # its KV cache is an object: refused
    with torch.no_grad():
        for _ in range(4):
            ids = torch.randint(0, 100, (1, 12))
            want = local(ids).logits
            assert torch.equal(fwd(ids.to(remote)).cpu(), want)
            assert torch.equal(whole(ids.to(remote)).logits.cpu(), want)
    assert fwd.stats()["replays"] == 2, fwd.stats()
    assert whole.stats()["replays"] == 0
    assert any("DynamicCache" in why for why in whole.stats()["plain"]), whole.stats()


class _Keeps(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.last = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last = x * 2  # kept on the module: a replay could not update it
        return self.lin(self.last)


def _reads(x):
    return x * float(x.sum().item() > 0)


def _draws(x):
    return x + torch.rand_like(x)


@pytest.mark.parametrize("case", ["a value read", "random numbers"])
def test_what_a_replay_would_get_wrong_runs_as_it_is_and_random_numbers_replay(remote, case):
    """A value read runs as it is; random numbers replay (Note [replayed draws]), drawing
    what eager draws at each call."""
    fn = _reads if case == "a value read" else _draws
    fwd = djinn.replayable(fn)
    torch.manual_seed(1)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(5)
            state = torch.get_rng_state()
            got = fwd(x.to(remote)).cpu()
            torch.set_rng_state(state)
            assert torch.equal(got, fn(x))
    stats = fwd.stats()
    if fn is _draws:
        assert stats["replays"] == 2 and stats["plain"] == {}, stats
        return
    assert stats["replays"] == 0 and stats["recordings"] == 0
    assert any("read a value" in why for why in stats["plain"]), stats


def test_a_tensor_with_an_autograd_history_is_never_replayed(remote):
    w = torch.randn(3, 3, requires_grad=True)
    rw = w.detach().to(remote).requires_grad_()
    fwd = djinn.replayable(lambda x: x @ rw)
    for _ in range(3):
        x = torch.randn(2, 3)
        fwd(x.to(remote)).sum().backward()  # the history a replay would not have built
        (x @ w).sum().backward()
    assert torch.equal(rw.grad.cpu(), w.grad)
    stats = fwd.stats()
    assert stats["replays"] == 0 and any("autograd" in why for why in stats["plain"]), stats


def test_a_tensor_kept_on_a_module_is_never_replayed(remote):
    torch.manual_seed(0)
    local = _Keeps().eval()
    model = _moved(local, remote)
    fwd = djinn.replayable(lambda x: model(x))
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(2, 4)
            assert torch.equal(fwd(x.to(remote)).cpu(), local(x))
            assert torch.equal(model.last.cpu(), x * 2)  # as fresh as the call's
    stats = fwd.stats()
    assert stats["replays"] == 0 and any("keeps a tensor" in w for w in stats["plain"]), stats


def test_a_float_that_changes_between_calls_keeps_it_recording(remote):
    """An optimizer's bias correction, a schedule: Python state a replay would freeze."""
    step = [0.0]

    def scaled(x):
        step[0] += 1.0
        return x * (0.5 + step[0])

    fwd = djinn.replayable(scaled)
    for i in range(5):
        x = torch.randn(3)
        assert torch.equal(fwd(x.to(remote)).cpu(), x * (0.5 + (i + 1.0)))
    stats = fwd.stats()
    assert stats["replays"] == 0 and stats["recordings"] == 5


def test_local_tensor_arguments_run_as_they_are(remote):
    fwd = djinn.replayable(lambda x, y: x + y.to(x.device))
    for _ in range(3):
        x, y = torch.randn(3), torch.randn(3)
        assert torch.equal(fwd(x.to(remote), y).cpu(), x + y)
    assert fwd.stats()["replays"] == 0
    assert any("local tensor" in w for w in fwd.stats()["plain"])


def test_a_failing_replay_raises_and_the_next_call_works(remote):
    table = torch.randn(6, 3)
    rtable = table.to(remote)
    fwd = djinn.replayable(lambda idx: rtable.index_select(0, idx) * 2)
    for _ in range(3):
        idx = torch.tensor([0, 5, 2])
        assert torch.equal(fwd(idx.to(remote)).cpu(), table.index_select(0, idx) * 2)
    with pytest.raises(DjinnError, match="index"):
        fwd(torch.tensor([0, 9, 2]).to(remote)).cpu()
    idx = torch.tensor([1, 1, 3])
    assert torch.equal(fwd(idx.to(remote)).cpu(), table.index_select(0, idx) * 2)
    assert fwd.stats()["replays"] >= 2


def test_a_call_whose_caught_failure_ran_as_captured_is_not_recorded(remote):
    """A call whose op failed ran as captured: its rest ran again and computed, as
    eager's ``try`` in the function has it (the appliance's Note [values the rest
    reads]). Recorded, it made replays of the next such calls, each failing as a whole
    (a review): its index error raised where eager computes. Only calls that did not
    fail are recorded (docs/concepts.md says what a replay of a failing op does)."""
    from tests.caught_failures import caught_index

    fwd = djinn.replayable(caught_index)
    base = torch.tensor([1.0, 5.0, 3.0, 2.0])
    x = base.to(remote)
    for _ in range(4):
        want = caught_index(base, torch.tensor([10]))
        assert torch.equal(fwd(x, torch.tensor([10]).to(remote)).cpu(), want)
    stats = fwd.stats()
    assert stats["replays"] == stats["recordings"] == 0
    assert stats["plain"] == {"an op failed when its graph ran": 4}
    for _ in range(4):  # calls that do not fail record, then replay
        want = caught_index(base, torch.tensor([1]))
        assert torch.equal(fwd(x, torch.tensor([1]).to(remote)).cpu(), want)
    assert fwd.stats()["replays"] >= 1


def test_a_failed_replay_landed_by_another_threads_unrelated_read_is_not_raised_there(remote):
    """A replay fails as a whole where it lands (Note [asynchronous replays]); another
    thread whose unrelated read lands it gets its value, as in eager, and the replay's
    output still raises its error where it is read."""
    import threading

    table = torch.randn(6, 3)
    rtable = table.to(remote)
    other = torch.arange(3.0).to(remote)
    fwd = djinn.replayable(lambda idx: rtable.index_select(0, idx) * 2)
    for _ in range(3):
        fwd(torch.tensor([0, 5, 2]).to(remote)).cpu()
    bad = torch.tensor([0, 9, 2]).to(remote)
    inflight.land_all()  # the put of ``bad``
    out = fwd(bad)  # sent, not landed
    got: list = []

    def read() -> None:
        try:
            got.append((other + 1).cpu())
        except DjinnError as exc:
            got.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    reader.join()
    assert fwd.stats()["replays"] >= 2
    assert torch.equal(got[0], torch.arange(3.0) + 1), got
    with pytest.raises(DjinnError, match="index"):
        out.cpu()


def test_reset_forgets_recordings_and_bad_arguments_are_refused(remote):
    fwd = djinn.replayable(lambda x: x * 2)
    x = torch.randn(3).to(remote)
    for _ in range(3):
        fwd(x)
    fwd.reset()
    fwd(x)
    assert fwd.stats()["recordings"] == 3 and fwd.stats()["keys"] == 1
    with pytest.raises(TypeError):
        djinn.replayable(3)
    with pytest.raises(ValueError):
        djinn.replayable(lambda x: x, after=0)
    decorated = djinn.replayable(after=1)(lambda x: x + 1)
    for _ in range(2):
        assert torch.equal(decorated(x).cpu(), x.cpu() + 1)
    assert decorated.stats()["replays"] == 1


def test_a_module_switched_to_training_records_again(remote):
    torch.manual_seed(0)
    local = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.BatchNorm1d(6)).eval()
    model = _moved(local, remote)
    fwd = djinn.replayable(model)
    x = torch.randn(5, 6)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(fwd(x.to(remote)).cpu(), local(x))
        model.train()  # batch statistics now, and running statistics updated in place
        local.train()
        for _ in range(3):
            assert torch.allclose(fwd(x.to(remote)).cpu(), local(x), atol=1e-6)
        assert torch.allclose(model[1].running_mean.cpu(), local[1].running_mean, atol=1e-6)
    stats = fwd.stats()
    assert stats["recordings"] == 4 and stats["replays"] == 2, stats


def test_an_output_returned_twice_is_one_tensor(remote):
    fwd = djinn.replayable(lambda x: (y := x * 3, y))
    x = torch.randn(4).to(remote)
    for _ in range(3):
        a, b = fwd(x)
        assert a is b and torch.equal(a.cpu(), x.cpu() * 3)
    assert fwd.stats()["replays"] == 1


def test_a_parameter_reassigned_on_a_module_records_again(remote):
    local = _mlp()
    model = _moved(local, remote)
    fwd = djinn.replayable(lambda x: model(x))
    x = torch.randn(3, 16)
    with torch.no_grad():
        for _ in range(3):
            fwd(x.to(remote))
        fresh = torch.randn(32, 16)
        # a new Parameter object: the old one, still alive here, keeps its handle
        old = model[0].weight
        model[0].weight = torch.nn.Parameter(fresh.to(remote))
        local[0].weight = torch.nn.Parameter(fresh)
        assert torch.equal(fwd(x.to(remote)).cpu(), local(x))
        assert old is not None
    assert fwd.stats()["recordings"] == 3


# -- found by a review: each gave a replay other numbers than a capture -----------------------
def _three(fwd, calls):
    """Each call's result; the first two record, the third would replay."""
    return [fwd(*c) for c in calls]


def test_an_argument_that_is_a_weight_it_reads_is_not_replayed(remote):
    w = torch.randn(3, 3)
    rw = w.to(remote)
    fwd = djinn.replayable(lambda x: x @ rw)
    y = torch.randn(3, 3)
    got = _three(fwd, [(rw,), (rw,), (y.to(remote),)])
    assert torch.equal(got[2].cpu(), y @ w)
    assert torch.equal(got[0].cpu(), w @ w)


def test_two_arguments_of_one_handle_key_apart_from_two_tensors(remote):
    fwd = djinn.replayable(lambda a, b: a * 2 + b)
    x = torch.randn(4).to(remote)
    _three(fwd, [(x, x.detach()), (x, x.detach())])
    a, b = torch.randn(4), torch.randn(4)
    assert torch.equal(fwd(a.to(remote), b.to(remote)).cpu(), a * 2 + b)


def test_a_weight_read_under_two_names_is_guarded_under_both(remote):
    w = torch.randn(3).to(remote)
    alias = w.detach()
    fwd = djinn.replayable(lambda x: x * alias + w)
    x = torch.randn(3).to(remote)
    _three(fwd, [(x,), (x,)])
    fresh = torch.randn(3)
    w.data = fresh.to(remote)  # w is another value now; alias keeps the old one
    assert torch.equal(fwd(x).cpu(), x.cpu() * alias.cpu() + fresh)


def test_weights_swapped_in_for_evaluation_are_read(remote):
    """An EMA's weights swapped into the model (torch.utils.swap_tensors) for an
    evaluation, and back."""
    local = _mlp()
    model = _moved(local, remote)
    ema = [p.detach().clone() * 0.5 for p in model.parameters()]
    fwd = djinn.replayable(lambda x: model(x))
    x = torch.randn(3, 16)
    with torch.no_grad():
        for _ in range(3):
            fwd(x.to(remote))
        for p, e in zip(model.parameters(), ema, strict=True):
            torch.utils.swap_tensors(p, torch.nn.Parameter(e))
        for q in local.parameters():
            q.mul_(0.5)
        assert torch.equal(fwd(x.to(remote)).cpu(), local(x))


def test_an_autograd_history_written_into_a_tensor_it_reads_is_not_replayed(remote):
    lin = _moved(torch.nn.Linear(3, 3), remote)
    buf = torch.zeros(3).to(remote)

    def fn(x):
        buf.copy_(lin(x))
        return buf.detach() * 2

    fwd = djinn.replayable(fn)
    for _ in range(3):
        fwd(torch.randn(3).to(remote))
        assert buf.grad_fn is not None  # as eager leaves it
    assert fwd.stats()["replays"] == 0


def test_a_replays_in_place_writes_count_as_eagers_do(remote):
    lin = _moved(torch.nn.Linear(3, 3), remote)
    fwd = djinn.replayable(lambda x: x.mul_(2) + 0)
    x = torch.randn(3).to(remote)
    for _ in range(3):
        fwd(x)
    y = lin(x)  # saves x for its backward
    fwd(x)  # a replay writes x again
    assert fwd.stats()["replays"] == 2
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_minus_zero_is_another_argument(remote):
    fwd = djinn.replayable(lambda x, s: 1 / (x * s))
    x = torch.tensor([1.0, -1.0]).to(remote)
    for _ in range(3):
        fwd(x, 0.0)
    assert torch.equal(fwd(x, -0.0).cpu(), 1 / (x.cpu() * -0.0))
    assert fwd.stats()["keys"] == 2


@pytest.mark.parametrize("reached", ["a method of an object", "a partial", "a dict"])
def test_a_module_switched_to_training_is_seen_however_fn_reaches_it(remote, reached):
    import functools

    torch.manual_seed(0)
    local = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.BatchNorm1d(6)).eval()
    model = _moved(local, remote)

    class Pipe:
        def __init__(self, m):
            self.m = m

        def run(self, x):
            return self.m(x)

    nets = {"net": model}
    fn = {
        "a method of an object": Pipe(model).run,
        "a partial": functools.partial(model),
        "a dict": lambda x: nets["net"](x),
    }[reached]
    fwd = djinn.replayable(fn)
    x = torch.randn(5, 6)
    with torch.no_grad():
        for _ in range(3):
            fwd(x.to(remote))
        model.train()
        local.train()
        assert torch.allclose(fwd(x.to(remote)).cpu(), local(x), atol=1e-6)


@pytest.mark.parametrize("moved", [False, True])
def test_a_local_tensor_it_reads_is_read_as_it_is_now(remote, moved):
    mask = torch.ones(3)
    fwd = djinn.replayable(lambda x: x * (mask.to(x.device) if moved else mask))
    x = torch.randn(3).to(remote)
    _three(fwd, [(x,), (x,), (x,)])
    mask[1] = 0
    assert torch.equal(fwd(x).cpu(), x.cpu() * mask)


def test_a_method_can_be_replayable_and_a_module_argument_is_not_kept(remote):
    import weakref

    class Scaler:
        def __init__(self, s):
            self.s = s

        @djinn.replayable
        def apply(self, x):
            return x * self.s

    x = torch.randn(3).to(remote)
    a = Scaler(2.0)
    for _ in range(3):
        assert torch.equal(a.apply(x).cpu(), x.cpu() * 2)
    fwd = djinn.replayable(lambda m, v: m(v))
    m = _moved(torch.nn.Linear(3, 3), remote)
    fwd(m, x)
    gone = weakref.ref(m)
    del m
    gc.collect()
    assert gone() is None  # the key names it by identity, never holds it


def test_a_recording_leaves_pytorchs_global_hooks_as_they_were(remote):
    from torch.optim.optimizer import _global_optimizer_pre_hooks

    hooks = torch.nn.modules.module._global_forward_pre_hooks
    before = (len(hooks), len(_global_optimizer_pre_hooks))
    model = _moved(_mlp(), remote)
    fwd = djinn.replayable(lambda x: model(x))
    with torch.no_grad():
        fwd(torch.randn(2, 16).to(remote))
    assert (len(hooks), len(_global_optimizer_pre_hooks)) == before
    assert fwd.stats()["recordings"] == 1


def test_a_replayable_method_sees_its_modules_flag(remote):
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)

        @djinn.replayable
        def run(self, x):
            return self.lin(x) * (2.0 if self.training else 1.0)

    torch.manual_seed(0)
    local = Scaled()
    model = _moved(local, remote)
    x = torch.randn(2, 3)
    with torch.no_grad():
        for _ in range(3):
            model.run(x.to(remote))
        model.eval()
        assert torch.equal(model.run(x.to(remote)).cpu(), local.lin(x))


def test_a_recording_works_out_its_graphs_template_once(remote, monkeypatch):
    """The template the wire needs is the record's: one walk of the graph, not two."""
    from djinn.protocol import templates

    model = _moved(_mlp(blocks=4), remote).requires_grad_(False)
    fwd = djinn.replayable(lambda x: model(x))
    x = torch.randn(8, 16).to(remote)
    fwd(x).cpu()  # the upload and the first recording; the template is now kept remotely
    walks = []
    real = templates.template
    monkeypatch.setattr(templates, "template", lambda body: walks.append(1) or real(body))
    out = fwd(x)
    assert fwd.stats()["recordings"] == 2 and len(walks) == 1, fwd.stats()
    assert torch.equal(out.cpu(), fwd(x).cpu()) and fwd.stats()["replays"] == 1
