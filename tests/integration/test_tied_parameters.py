"""Note [tied parameters] (djinn/frontend/ties.py): a parameter shared by two modules stays
one parameter through ``model.to(remote)``, as it does through ``model.to("cuda")``, so a
tied model trains with local eager's numbers (it was two parameters that trained apart).
A move that swaps the parameter keeps the tie by itself; one that makes new ``Parameter``
objects (back to the CPU, or a parameter something else holds) keeps it by recording."""

from __future__ import annotations

import weakref

import pytest
import torch

R = "remote_accelerator:0"


class Tied(torch.nn.Module):
    """An encoder and a head sharing one weight, a second name for it inside one module,
    and a buffer: the shapes of weight tying in language models."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = torch.nn.Linear(6, 6, bias=False)
        self.mid = torch.nn.Linear(6, 6)
        self.head = torch.nn.Linear(6, 6)
        self.head.weight = self.enc.weight
        self.mid.register_parameter("alias", self.mid.bias)
        self.register_buffer("scale", torch.full((6,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.enc(x) * self.scale)
        h = torch.tanh(self.mid(h) + self.mid.alias)
        return self.head(h)


def _trained(device: str, **to_kwargs) -> tuple[Tied, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = Tied().to(device, **to_kwargs)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1)).to(device, **to_kwargs)
    for _ in range(3):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    return model, [p.detach().cpu() for p in model.parameters()]


def test_a_shared_parameter_stays_one_object_and_trains_as_local_eager(remote):
    model, got = _trained(R)
    _, want = _trained("cpu")
    assert model.head.weight is model.enc.weight
    assert model.mid.alias is model.mid.bias
    assert len(got) == len(want) == 4  # enc/head weight, mid weight, mid bias/alias, head bias
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    assert model.head.weight.grad is model.enc.weight.grad  # one gradient, both uses summed


def test_the_module_is_left_with_plain_parameter_dicts_and_local_names(remote):
    model = Tied().to(R)
    assert all(type(m._parameters) is dict for m in model.modules())
    local = Tied()
    assert list(model.state_dict()) == list(local.state_dict())
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in local.named_parameters()]


def test_a_move_that_casts_keeps_the_tie(remote):
    model, got = _trained(R, dtype=torch.float64)
    _, want = _trained("cpu", dtype=torch.float64)
    assert model.head.weight is model.enc.weight and model.enc.weight.dtype == torch.float64
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_a_buffer_shared_by_two_modules_is_copied_apart_as_on_cuda(remote):
    a, b = torch.nn.BatchNorm1d(3), torch.nn.BatchNorm1d(3)
    b.running_mean = a.running_mean
    pair = torch.nn.Sequential(a, b).to(R)
    assert pair[0].running_mean is not pair[1].running_mean
    pair[0].running_mean.add_(1.0)
    assert torch.equal(pair[1].running_mean.cpu(), torch.zeros(3))


def test_a_shared_parameter_and_its_gradient_travel_once(remote, monkeypatch):
    from djinn.frontend.session import default_session

    enc, head = torch.nn.Embedding(512, 256), torch.nn.Linear(256, 512, bias=False)
    head.weight = enc.weight  # 512 KiB: past the inline size, so moved by a put
    enc.weight.grad = torch.full((512, 256), 2.0)
    want = enc.weight.detach().clone()
    session = default_session()
    uploaded: list[int] = []
    real_put = session.put

    def counting_put(t, *args, **kwargs):
        uploaded.append(t.numel() * t.element_size())
        return real_put(t, *args, **kwargs)

    monkeypatch.setattr(session, "put", counting_put)
    model = torch.nn.Sequential(enc, head).to(R)
    monkeypatch.undo()
    assert uploaded == [512 * 256 * 4] * 2  # the weight, its gradient
    assert model[1].weight is model[0].weight
    assert torch.equal(model[1].weight.cpu(), want)
    assert torch.equal(model[1].weight.grad.cpu(), torch.full((512, 256), 2.0))


def test_a_submodule_moved_first_keeps_the_tie_as_on_cuda(remote):
    model = Tied()
    model.head.to(R)  # on CUDA the shared object itself moves: enc.weight with it
    model.to(R)
    assert model.head.weight is model.enc.weight
    assert len(list(model.parameters())) == 4


def test_a_move_tried_again_after_a_failure_keeps_the_tie(remote, monkeypatch):
    from djinn.frontend import factories

    model, real, calls = Tied(), factories.special_ops.copy_into, []

    def failing_once(dst, local, *args):
        calls.append(1)
        if len(calls) == 2:
            raise ConnectionError("an upload failed")
        return real(dst, local, *args)

    monkeypatch.setattr(factories.special_ops, "copy_into", failing_once)
    with pytest.raises(ConnectionError):
        model.to(R)  # enc moved, then mid failed: head still holds the CPU parameter
    monkeypatch.undo()
    model.to(R)
    assert model.head.weight is model.enc.weight
    assert len(list(model.parameters())) == 4


def test_moved_back_to_the_cpu_a_shared_parameter_stays_one(remote):
    model = Tied().to(R).cpu()
    assert model.head.weight is model.enc.weight and model.enc.weight.device.type == "cpu"
    assert model.mid.alias is model.mid.bias


def test_a_parameter_written_after_its_move_is_written_where_it_moved(remote):
    a, b = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
    shared = a.weight
    want = shared.detach() + 1.0
    a.to(R)  # as on CUDA: `shared` is a's parameter, moved
    with torch.no_grad():
        shared.add_(1.0)
    b.weight = shared
    b.to(R)
    assert b.weight is a.weight is shared
    assert torch.equal(b.weight.cpu(), want)


def test_a_parameter_written_since_a_move_made_a_new_one_is_moved_again_not_tied(remote):
    a, b = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
    shared = a.weight
    held = weakref.ref(shared)  # a weak reference: the move cannot swap it
    with pytest.warns(RuntimeWarning, match="new Parameter"):
        a.to(R)  # a's slot holds a new remote Parameter; `shared` is still on the CPU
    with torch.no_grad():
        shared.add_(1.0)  # written on the CPU since: the remote copy no longer stands for it
    b.weight = shared
    with pytest.warns(RuntimeWarning, match="new Parameter"):
        b.to(R)
    assert b.weight is not a.weight and held() is shared
    assert torch.equal(b.weight.cpu(), shared.detach())


def test_a_move_that_makes_new_parameters_keeps_no_cpu_parameter_alive(remote):
    import gc

    model = Tied()
    refs = [weakref.ref(p) for p in model.parameters()]  # so the move cannot swap them
    with pytest.warns(RuntimeWarning, match="new Parameter"):
        model.to(R)
    assert model.head.weight is model.enc.weight  # the recorded tie
    gc.collect()
    assert all(r() is None for r in refs)


def test_a_parameter_given_new_data_since_its_move_is_moved_again(remote):
    """``.data =`` replaces the bytes without counting a version (found by review)."""
    enc, head = torch.nn.Linear(3, 3, bias=False), torch.nn.Linear(3, 3, bias=False)
    head.weight = enc.weight
    held = weakref.ref(enc.weight)  # the move makes a new Parameter: head's is still local
    with pytest.warns(RuntimeWarning, match="new Parameter"):
        enc.to(R)
    assert held() is head.weight and head.weight.device.type == "cpu"
    head.weight.data = torch.full((3, 3), 7.0)
    head.to(R)
    assert torch.equal(head.weight.cpu(), torch.full((3, 3), 7.0))
