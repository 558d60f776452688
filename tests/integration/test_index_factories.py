"""Ops the appliance's allowlist lacked (UNSUPPORTED_OP): ``torch.tril_indices`` and
``triu_indices`` made on the remote device (code that builds a triangular mask's indices
there: pairwise losses, attention biases), the integer shifts and ``torch.logspace``."""

from __future__ import annotations

import pytest
import torch

R = "remote_accelerator:0"


@pytest.mark.parametrize("make", [torch.tril_indices, torch.triu_indices], ids=["tril", "triu"])
def test_triangle_indices_match_local_eager(remote, make):
    for args in [(3, 3), (4, 2, 1), (2, 5, -1), (0, 3)]:
        got = make(*args, device=R)
        assert got.device.type == "remote_accelerator"
        assert torch.equal(got.cpu(), make(*args))
    x = torch.arange(16.0).view(4, 4)
    i, j = make(4, 4, device=R)
    assert torch.equal(x.to(R)[i, j].cpu(), x[tuple(make(4, 4))])


def test_shifts_and_logspace_match_local_eager(remote):
    """``x << 2``, ``x >> 1`` (``__lshift__``, ``__rshift__`` and their in-place forms) and
    ``torch.logspace`` were not on the allowlist either (a review's integer programs)."""
    x = torch.tensor([1, -2, 3, 8])
    u = torch.tensor([1, 2, 3, 200], dtype=torch.uint8)
    rx, ru = x.to(R), u.to(R)
    assert torch.equal((rx << 2).cpu(), x << 2)
    assert torch.equal((rx >> 1).cpu(), x >> 1)
    assert torch.equal((rx << (rx.abs() % 5)).cpu(), x << (x.abs() % 5))
    assert torch.equal((ru << 3).cpu(), u << 3)
    y, ry = x.clone(), rx.clone()
    y <<= 1
    ry <<= 1
    y >>= 2
    ry >>= 2
    assert torch.equal(ry.cpu(), y)
    got = torch.logspace(0, 3, 4, base=2, device=R, dtype=torch.float64)
    assert torch.equal(got.cpu(), torch.logspace(0, 3, 4, base=2, dtype=torch.float64))
    assert torch.equal(torch.logspace(0, 2, 5, device=R).cpu(), torch.logspace(0, 2, 5))
