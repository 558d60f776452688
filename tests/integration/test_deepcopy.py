"""``copy.deepcopy`` of remote tensors and moved modules: a copy made on the appliance, as
a CUDA tensor's is made on its GPU (it failed: the session's connection cannot be
pickled). Best-checkpoint and EMA copies of a model are made this way."""

from __future__ import annotations

import copy

import pytest
import torch

R = "remote_accelerator:0"


def test_a_moved_model_copies_into_an_independent_equal_model(remote):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)).to(R)
    model[0].weight.grad = torch.ones(4, 4, device=R)
    twin = copy.deepcopy(model)
    for (name, p), (_, q) in zip(model.named_parameters(), twin.named_parameters(), strict=True):
        assert isinstance(q, torch.nn.Parameter) and q.requires_grad, name
        assert q is not p and torch.equal(q.cpu(), p.cpu()), name
    assert twin[0].weight.grad is None  # as Parameter.__deepcopy__: the value only
    with torch.no_grad():
        twin[0].weight.add_(1.0)  # the copy's own bytes
    twin(torch.randn(3, 4, device=R))  # and its own running statistics
    assert not torch.equal(twin[0].weight.cpu(), model[0].weight.cpu())
    assert torch.equal(model[1].running_mean.cpu(), torch.zeros(4))


def test_a_tied_parameter_stays_tied_in_the_copy(remote):
    enc, head = torch.nn.Linear(3, 3, bias=False), torch.nn.Linear(3, 3, bias=False)
    head.weight = enc.weight
    twin = copy.deepcopy(torch.nn.Sequential(enc, head).to(R))
    assert twin[0].weight is twin[1].weight


def test_a_computed_tensor_copies_and_a_non_leaf_refuses_as_eager_does(remote):
    x = torch.ones(3, device=R) * 2
    assert torch.equal(copy.deepcopy(x).cpu(), torch.full((3,), 2.0))
    w = torch.ones(3, device=R, requires_grad=True) * 2
    with pytest.raises(RuntimeError, match="graph leaves"):
        copy.deepcopy(w)


def test_a_tensor_whose_sizes_python_answers_copies(remote):
    """``arange``'s output carries PyTorch's cached size capsules, which cannot be copied
    (found by review)."""
    m = torch.nn.Module()
    m.register_buffer("steps", torch.arange(10, device=R))
    twin = copy.deepcopy(m)
    assert torch.equal(twin.steps.cpu(), torch.arange(10))
    x = torch.arange(4.0, device=R)
    x.grad = torch.ones(4, device=R)
    assert torch.equal(copy.deepcopy(x).grad.cpu(), torch.ones(4))  # a tensor's grad goes along


def test_a_shallow_copy_shares_its_tensors_bytes_as_eagers(remote):
    """``copy.copy`` went through ``__reduce_ex__``, which fetches the bytes: the copy had
    its own, and a write through it never reached the tensor (a hunt)."""
    import copy

    def run(device: str) -> list[torch.Tensor]:
        x = torch.arange(6.0).to(device).requires_grad_()
        x.tag = "mine"
        weight = torch.nn.Linear(3, 2).to(device).weight
        view = torch.arange(6.0).reshape(2, 3).to(device)[1]
        copies = [copy.copy(t) for t in (x, weight, view)]
        assert copies[0].tag == "mine" and copies[0].requires_grad and copies[0].is_leaf
        assert isinstance(copies[1], torch.nn.Parameter)
        with torch.no_grad():
            for c in copies:
                c.mul_(2).add_(1)
        return [x, weight, view]

    torch.manual_seed(0)
    want = run("cpu")
    torch.manual_seed(0)
    for got, w in zip(run(R), want, strict=True):
        assert torch.equal(got.detach().cpu(), w.detach())
