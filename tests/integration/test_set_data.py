"""Note [set data] (frontend/lazy.py): ``t.data = other`` on a remote tensor gives it the
other's value, as eager does; it kept its old value under the new dtype and shape, so
``model.half()`` after a move computed in float32 and ``vector_to_parameters`` wrote
nothing."""

from __future__ import annotations

import torch

R = "remote_accelerator:0"


def test_assigning_data_gives_the_tensor_the_new_value_and_shape(remote):
    lin = torch.nn.Linear(3, 2).to(R)
    lin.weight.data = torch.zeros(2, 3, device=R)
    assert torch.equal(lin.weight.cpu(), torch.zeros(2, 3))
    assert isinstance(lin.weight, torch.nn.Parameter) and lin.weight.requires_grad
    u = torch.ones(3, device=R)
    u.data = torch.arange(6.0, device=R)  # a factory whose size an out= kernel set
    assert u.shape == (6,) and torch.equal(u.cpu(), torch.arange(6.0))
    a = torch.arange(3.0, device=R)  # and the other way round
    a.data = torch.ones(5, device=R)
    assert a.shape == (5,) and torch.equal((a + 1).cpu(), torch.full((5,), 2.0))


def _half_then_double(device: str) -> tuple:
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 3).to(device)
    m.half()
    half = (m.weight * 3 + 0.1).cpu()
    m.double()
    out = m(torch.full((2, 4), 1e-3, dtype=torch.float64).to(device))
    return half, ((m.weight + 1e-12) - m.weight).cpu(), out.dtype, out.detach().cpu()


def test_a_module_cast_after_its_move_computes_in_the_new_dtype(remote):
    got, want = _half_then_double(R), _half_then_double("cpu")
    assert got[2] == want[2] == torch.float64
    for g, w in zip(got[:2] + got[3:], want[:2] + want[3:], strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w)


def test_vector_to_parameters_writes_the_parameters(remote):
    from torch.nn.utils import parameters_to_vector, vector_to_parameters

    m = torch.nn.Linear(2, 2).to(R)
    vector_to_parameters(torch.arange(6.0, device=R), m.parameters())
    assert torch.equal(parameters_to_vector(m.parameters()).cpu(), torch.arange(6.0))
    assert torch.equal(m.weight.cpu(), torch.arange(4.0).reshape(2, 2))


def test_data_from_an_allocation_not_written_yet_shares_it(remote):
    """``p.data = e`` then a write into ``e``: both name one allocation, as in eager (the
    two got allocations of their own, and ``p`` read uninitialised bytes)."""
    p = torch.zeros(3, device=R)
    e = torch.empty(3, device=R)
    p.data = e
    e.fill_(1.0)
    assert p.cpu().tolist() == [1.0, 1.0, 1.0]
