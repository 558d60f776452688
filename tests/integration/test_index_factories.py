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


def test_bincount_and_repeat_interleave_of_a_tensor_run(remote):
    """Output lengths that are values of the input (Note [sizes by value]): they were
    UNSUPPORTED_OP, their kernels trusting the values they size by."""
    x = torch.tensor([1, 3, 3, 0, 7])
    w = torch.tensor([0.5, 1.0, 2.0, 4.0, 8.0])
    r = torch.tensor([2, 0, 1])
    cases = [
        lambda d: torch.bincount(x.to(d)),
        lambda d: torch.bincount(x.to(d), minlength=10),
        lambda d: torch.bincount(x.to(d), weights=w.to(d)),
        lambda d: torch.bincount(x[:0].to(d), minlength=3),
        lambda d: torch.repeat_interleave(r.to(d)),
        lambda d: torch.repeat_interleave(x[:3].to(d), r.to(d)),
        lambda d: x[:3].to(d).repeat_interleave(r.to(d), output_size=3),
        lambda d: torch.arange(6.0).view(3, 2).to(d).repeat_interleave(r.to(d), dim=0),
    ]
    for case in cases:
        want = case("cpu")
        got = case(R)
        assert got.dtype == want.dtype and torch.equal(got.cpu(), want)
    # through autograd: repeat_interleave's gradient sums the repeated rows back
    grads = []
    for d in ("cpu", R):
        leaf = torch.arange(6.0).view(3, 2).requires_grad_()
        (leaf.to(d).repeat_interleave(r.to(d), dim=0) ** 2).sum().backward()
        grads.append(leaf.grad)
    assert torch.equal(grads[0], grads[1])
    with pytest.raises(RuntimeError, match="repeats can not be negative"):
        torch.repeat_interleave(torch.tensor([1, -1]).to(R)).cpu()
