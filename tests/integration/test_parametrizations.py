"""``Tensor.set_(other)`` on remote tensors, and PyTorch's parametrizations, which use it
(special_ops._set_source): registered after the move, and assigned to, they were refused
(``aten::set_.source_Tensor``), and the error met at a later, unrelated line."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

from djinn.errors import UnsupportedOp

R = "remote_accelerator:0"


class _Symmetric(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.triu() + x.triu(1).transpose(-1, -2)

    def right_inverse(self, a: torch.Tensor) -> torch.Tensor:
        return a.triu()


def _train(device: str) -> list[float]:
    torch.manual_seed(0)
    lin = nn.Linear(3, 3).to(device)  # moved first, then parametrized
    parametrize.register_parametrization(lin, "weight", _Symmetric())
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    seen = []
    for _ in range(3):
        loss = lin(torch.ones(2, 3, device=device)).pow(2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        seen.append(loss.item())
    lin.weight = torch.eye(3, device=device) * 2  # through right_inverse, then set_
    seen += lin.weight.flatten().tolist()
    seen.append(lin.parametrizations.weight.original.sum().item())
    with parametrize.cached():
        seen.append(lin(torch.ones(1, 3, device=device)).sum().item())
    return seen


def test_a_parametrization_registered_after_the_move_trains_as_in_eager(remote):
    got, want = _train(R), _train("cpu")
    assert len(got) == len(want)
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1e-5


def test_set_shares_the_other_tensors_value_and_geometry(remote):
    for device in ("cpu", R):
        x = torch.zeros(2, 3, device=device)
        y = torch.arange(4.0, device=device)
        assert x.set_(y) is x
        assert x.shape == (4,) and x.stride() == (1,)
        x.add_(1)  # one storage: y sees it, as in eager
        assert y.cpu().tolist() == [1.0, 2.0, 3.0, 4.0] and x.cpu().tolist() == y.cpu().tolist()
        with pytest.raises(RuntimeError, match="Could not set tensor"):  # PyTorch's own word
            x.set_(torch.zeros(2, dtype=torch.float64, device=device))
    with pytest.raises(UnsupportedOp, match="set_"):  # a storage's: refused, typed
        torch.zeros(2, device=R).set_(torch.zeros(2).untyped_storage()).cpu()
    x = torch.zeros(2, device=R)
    with pytest.raises(UnsupportedOp, match="cannot take the storage of a cpu tensor"):
        x.set_(torch.ones(3))  # at the call, as eager refuses it (a review: at x.cpu())
    assert x.cpu().tolist() == [0.0, 0.0]
