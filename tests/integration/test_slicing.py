"""``x[:, 1:]`` on a remote tensor is ``slice(x, 1, 1, 2**63 - 1)``, and its backward
``slice_backward(..., end=2**63 - 1)``: PyTorch's "to the end", an integer the appliance
refuses (|x| <= 2**62). Capture clamps the bounds to the dimension, as the kernels do
(Note [slices to the end], djinn/frontend/slicing.py); both were INVALID_ARGUMENT."""

from __future__ import annotations

import torch

R = "remote_accelerator:0"


def test_slicing_to_the_end_gives_local_eagers_values(remote):
    x = torch.arange(24.0).reshape(4, 6)
    rx = x.to(R)
    assert torch.equal(rx[:, 1:].cpu(), x[:, 1:])
    assert torch.equal(rx[-99:, 2::2].cpu(), x[-99:, 2::2])
    assert torch.equal(rx[1:][:, :99].cpu(), x[1:][:, :99])
    got = torch.ops.aten.slice.Tensor(rx, 1, end=3).cpu()
    assert torch.equal(got, torch.ops.aten.slice.Tensor(x, 1, end=3))
    scattered = torch.slice_scatter(rx, torch.ones(4, 5).to(R), 1, 1).cpu()
    assert torch.equal(scattered, torch.slice_scatter(x, torch.ones(4, 5), 1, 1))


def test_its_backward_gives_local_eagers_gradient(remote):
    def grad(device: str) -> torch.Tensor:
        x = torch.arange(24.0).reshape(2, 12).to(device).requires_grad_()
        (x[:, 1:] * torch.arange(11.0).to(device)).sum().backward()
        return x.grad.cpu()

    assert torch.equal(grad(R), grad("cpu"))
