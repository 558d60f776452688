"""Note [parameters keep their identity] (djinn/frontend/ties.py): ``model.to(remote)``
keeps every ``Parameter`` object, as ``model.to("cuda")`` does, so whatever held one
before the move (an optimizer built first, a hook's closure, a second module) holds the
moved parameter. An optimizer built before the move stepped the CPU tensors: training
changed nothing, silently."""

from __future__ import annotations

import io
import sys
import warnings
import weakref

import pytest
import torch

R = "remote_accelerator:0"

OPTIMIZERS = {
    "adam_foreach": lambda ps: torch.optim.Adam(ps, lr=0.05, foreach=True),
    "adam_for_loop": lambda ps: torch.optim.Adam(ps, lr=0.05, foreach=False),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adamw_two_groups": lambda ps: torch.optim.AdamW(
        [{"params": ps[:2]}, {"params": ps[2:], "weight_decay": 0.0}], lr=0.05
    ),
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _train_with_optimizer_built_first(device: str, make_opt) -> list[torch.Tensor]:
    model = _model()
    opt = make_opt(list(model.parameters()))  # before the move: holds the objects it had
    model.to(device)
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1)).to(device)
    for _ in range(3):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    params = [p for group in opt.param_groups for p in group["params"]]
    assert [id(p) for p in params] == [id(p) for p in model.parameters()]
    return [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_an_optimizer_built_before_the_move_trains_as_local_eager(remote, name):
    got = _train_with_optimizer_built_first(R, OPTIMIZERS[name])
    want = _train_with_optimizer_built_first("cpu", OPTIMIZERS[name])
    assert any(not torch.equal(w, _model_params_before()[i]) for i, w in enumerate(want))
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def _model_params_before() -> list[torch.Tensor]:
    return [p.detach().clone() for p in _model().parameters()]


def test_a_move_keeps_each_parameter_and_gradient_object(remote):
    model = _model()
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    before = [(p, p.grad, p.detach().clone()) for p in model.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing holds them: no fallback, no warning
        model.to(R)
    for (param, grad, value), now in zip(before, model.parameters(), strict=True):
        assert now is param and now.grad is grad
        assert isinstance(now, torch.nn.Parameter) and now.device.type == R.split(":")[0]
        assert torch.equal(now.cpu(), value) and torch.equal(
            grad.cpu(), torch.full_like(value, 0.5)
        )


def test_a_parameter_an_autograd_graph_saved_moves_as_a_new_parameter_with_a_warning(remote):
    """A convolution's graph holds its weight: ``swap_tensors`` refuses such a tensor, so
    the move falls back to a new ``Parameter``, and says so (on CUDA the object is kept)."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(2, 3, 3)
    held = conv.weight
    out = conv(torch.randn(1, 2, 5, 5))  # the graph saved the weight
    with pytest.warns(RuntimeWarning, match=r"Conv2d\.weight moves .* as a new Parameter"):
        conv.to(R)
    assert conv.weight is not held and held.device.type == "cpu"
    assert conv.bias.device.type == R.split(":")[0]  # the bias was not saved: swapped
    assert torch.equal(conv.weight.cpu(), held.detach())
    del out


def test_a_parameter_held_by_a_weak_reference_moves_as_a_new_parameter(remote):
    lin = torch.nn.Linear(3, 3)
    ref = weakref.ref(lin.weight)
    with pytest.warns(RuntimeWarning, match="new Parameter"):
        lin.to(R)
    assert ref() is not lin.weight and lin.weight.device.type == R.split(":")[0]


def test_torch_compile_still_runs_a_remote_model_eagerly(remote):
    """The traceable-subclass protocol is shown to ``Module._apply`` only: dynamo does not
    try to trace a remote tensor's inside (it has none), and runs the model as before."""
    import torch._dynamo.utils

    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4).to(R)
    x = torch.randn(2, 4).to(R)
    compiled = torch.compile(lin)
    torch._dynamo.utils.counters.clear()
    assert torch.equal(compiled(x).cpu(), lin(x).cpu())
    # Note [dynamo skips djinn]: the capture's own Python (a remote tensor's stride(), the
    # op's schema) made nine graphs, compiled at the first two calls, guarded at each
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0, dict(
        torch._dynamo.utils.counters["stats"]
    )


def test_round_trips_to_the_cpu_keep_one_remote_copy_while_an_optimizer_holds_the_first(remote):
    """The record of a move back to the CPU held the new local Parameter, which the next
    move made remote in place: each round trip kept one more remote copy (found by
    review). A move back now keeps the Parameter objects too, so the optimizer holds the
    model's own: one copy, however many trips."""
    from djinn.frontend.session import default_session

    session = default_session()
    base = session.memory_allocated()
    lin = torch.nn.Linear(512, 512, bias=False)  # 1 MiB
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)  # holds the first Parameter
    lin.to(R)
    held = []
    for _ in range(4):
        lin.cpu()
        lin.to(R)
        lin.weight.sum().item()  # the moves land
        held.append(session.memory_allocated() - base)
    assert held == [held[0]] * 4 and held[0] <= (1 << 20) + 4096, held
    assert opt.param_groups[0]["params"][0] is lin.weight


def test_a_local_tensor_written_with_a_remote_operand_raises_as_on_cuda(remote):
    """``cpu.add_(remote)`` wrote into a remote copy and left the local tensor as it was:
    an optimizer whose state was built on the CPU (Adagrad builds it at once; a state
    loaded before the move) stepped garbage, silently (found by review)."""
    state = torch.zeros(3)
    g = torch.full((3,), 2.0).to(R)
    for write in (lambda: state.add_(g), lambda: state.addcmul_(g, g, value=1.0)):
        with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
            write()
    assert state.tolist() == [0.0, 0.0, 0.0]
    model = _model()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)  # its state is on the CPU
    model.to(R)
    model(torch.randn(2, 6).to(R)).sum().backward()
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        opt.step()


class _Slotted(torch.nn.Parameter):
    __slots__ = ("tag",)


class _Wrapper(torch.nn.Module):
    """A library's own ``to`` over a module's (as transformers' ``PreTrainedModel``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)

    def to(self, *args, **kwargs):
        return super().to(*args, **kwargs)


def test_a_parameter_class_with_slots_moves_as_a_new_parameter_with_a_warning(remote):
    lin = torch.nn.Linear(3, 3)
    lin.weight = _Slotted(lin.weight.detach())
    with pytest.warns(RuntimeWarning, match="__slots__") as caught:
        lin.to(R)
    assert caught[0].filename == __file__  # names this line, not torch's or djinn's
    assert lin.weight.device.type == R.split(":")[0]


def test_the_fallback_warning_names_the_programs_line_past_a_librarys_own_to(remote):
    wrapper = _Wrapper()
    keep = weakref.ref(wrapper.lin.weight)  # so the move cannot swap it
    with pytest.warns(RuntimeWarning, match="new Parameter") as caught:
        wrapper.to(R)
    line = sys._getframe().f_lineno - 1
    assert (caught[0].filename, caught[0].lineno) == (__file__, line)
    del keep


def _round_trip_training(device: str, make_opt) -> list[torch.Tensor]:
    model = _model().to(device)
    opt = make_opt(list(model.parameters()))
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
    for step in range(5):
        if step == 2:  # save a checkpoint from the CPU, then go on where it trained
            model.cpu()
            torch.save(model.state_dict(), io.BytesIO())
            model.to(device)
        opt.zero_grad()
        model(x.to(device)).pow(2).mean().backward()
        opt.step()
    return [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("name", ["adam_foreach", "sgd_momentum"])
def test_a_round_trip_to_the_cpu_keeps_the_optimizers_parameters(remote, name):
    """A move back to the CPU made new Parameter objects: after ``model.cpu()`` and
    ``model.to(remote)`` the optimizer stepped the old ones, and the model stopped
    training, silently (a review: SGD's weights froze at step 2)."""
    got = _round_trip_training(R, OPTIMIZERS[name])
    want = _round_trip_training("cpu", OPTIMIZERS[name])
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_a_move_back_keeps_each_parameter_and_moves_its_gradient(remote):
    model = _model().to(R)
    model(torch.ones(2, 6, device=R)).sum().backward()
    before = [(p, p.grad.cpu()) for p in model.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing holds them: no fallback, no warning
        model.cpu()
    for (param, grad), now in zip(before, model.parameters(), strict=True):
        assert now is param and type(now) is torch.nn.Parameter and now.device.type == "cpu"
        assert now.grad.device.type == "cpu" and torch.equal(now.grad, grad)


def test_a_remote_parameter_an_autograd_graph_saved_moves_back_as_a_new_one_with_its_grad(
    remote,
):
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(2, 3, 3).to(R)
    out = conv(torch.randn(1, 2, 5, 5, device=R))  # the graph saved the weight
    out.sum().backward(retain_graph=True)
    held, grad = conv.weight, conv.weight.grad.cpu()
    with pytest.warns(RuntimeWarning, match=r"Conv2d\.weight moves back from the remote"):
        conv.cpu()
    assert conv.weight is not held and conv.weight.device.type == "cpu"
    assert torch.equal(conv.weight.grad, grad)
    assert conv.bias.grad is not None and conv.bias.grad.device.type == "cpu"
    del out


def test_a_move_back_keeps_the_parameters_hooks_and_attributes(remote):
    """swap_tensors swaps attributes and tensor hooks too: a gradient hook registered on
    a remote parameter was lost by its move back, and the gradient came undoubled,
    silently (a review)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 2).to(R)
    weight = lin.weight
    weight.tag = "mine"
    calls = []
    weight.register_hook(lambda g: calls.append(1) or g * 2)
    lin.cpu()
    assert lin.weight is weight and weight.tag == "mine"
    lin(torch.ones(1, 3)).sum().backward()
    assert calls == [1] and torch.equal(weight.grad, torch.full((2, 3), 2.0))


@pytest.mark.parametrize("held", ["nothing", "a gradient", "a weak reference"])
def test_hooks_registered_before_the_move_run_after_it_as_eagers(remote, held):
    """Note [hooks through a swap]: a gradient hook and a post-accumulate hook registered
    before ``model.to(remote)`` stayed on the parameter's dict but never ran: the gradient
    came back undoubled and unzeroed, silently (a hunt). Each runs once per backward, as
    in eager, after a round trip too, and on a new Parameter where none could be swapped."""

    def run(device: str) -> tuple[list[torch.Tensor], list[str]]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
        calls: list[str] = []
        model[0].weight.register_hook(lambda g: calls.append("w0") or g * 10)
        model[2].bias.register_hook(lambda g: calls.append("b2") or g - 1)

        def zeroed(p: torch.Tensor) -> None:
            calls.append("post")
            p.grad.mul_(0)

        model[2].weight.register_post_accumulate_grad_hook(zeroed)
        x = torch.randn(5, 3)
        if held == "a gradient":  # _apply moves it apart
            model(x).sum().backward()
        # no swap with a weak reference held: a new Parameter, which takes the hooks (a
        # review), with a warning that an optimizer built before would not train it
        ref = weakref.ref(model[0].weight) if held == "a weak reference" else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            model.to(device)
        del ref
        for _ in range(2):
            model(x.to(device)).pow(2).sum().backward()
        model.cpu().to(device)  # there and back again
        model(x.to(device)).sum().backward()
        return [p.grad.cpu() for p in model.parameters()], calls

    (got, got_calls), (want, want_calls) = run(R), run("cpu")
    assert got_calls == want_calls
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
