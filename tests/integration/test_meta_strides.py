"""How a new tensor is laid out, on the client and on the worker.

Note [convolution layouts] (djinn/frontend/meta.py): the CPU convolution answers a
channels-last input (or weight) channels-last, where PyTorch's meta kernel says
contiguous; the client now says what the kernel does, so the program sees eager's
strides and the worker copies nothing.

Note [meta strides] (appliance/executor/graph.py): where a kernel still lays a new
tensor out otherwise than the client was told (``linalg.svd``'s ``Vh`` on the CPU), the
worker copies it into the client's layout. Before both, a view the client decided on its
strides read other elements on the worker, and the group norm after a channels-last
convolution refused its input there (a review: diffusers' UNet2DModel in eval mode
failed every forward)."""

from __future__ import annotations

import copy

import pytest
import torch


def _convolved(conv: torch.nn.Module, norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    h = conv(x)
    assert not h.is_contiguous() and h.is_contiguous(memory_format=torch.channels_last)
    return norm(h.reshape(2, 32, 16)).transpose(1, 2) + h.flatten(2).transpose(1, 2)


@pytest.mark.parametrize("channels_last", ["input", "weight", "both"])
def test_a_channels_last_convolution_is_laid_out_as_in_eager(remote, channels_last):
    torch.manual_seed(0)
    conv, norm = torch.nn.Conv2d(64, 32, 3, padding=1), torch.nn.GroupNorm(8, 32)
    x = torch.randn(2, 64, 4, 4)
    if channels_last in ("input", "both"):
        x = x.to(memory_format=torch.channels_last)
    if channels_last in ("weight", "both"):
        conv = conv.to(memory_format=torch.channels_last)
    with torch.no_grad():
        want = _convolved(conv, norm, x)
        moved = [copy.deepcopy(m).to(remote) for m in (conv, norm)]
        got = _convolved(*moved, x.to(remote))
        assert got.stride() == want.stride()
        assert torch.equal(got.cpu(), want)
    local = [copy.deepcopy(m) for m in (conv, norm)]  # in training too, with the gradients
    moved = [copy.deepcopy(m).to(remote) for m in (conv, norm)]
    _convolved(*local, x).square().sum().backward()
    _convolved(*moved, x.to(remote)).square().sum().backward()
    for a, b in zip(moved, local, strict=True):
        for p, q in zip(a.parameters(), b.parameters(), strict=True):
            assert (p.grad.cpu() - q.grad).abs().max().item() <= 1e-5 * q.grad.abs().max().item()


def test_a_kernel_laid_out_otherwise_is_copied_into_the_clients_layout(remote):
    """The CPU's ``Vh`` is column-major, meta's row-major: the client's ``view`` of it
    failed on the worker ("view size is not compatible")."""
    a = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
    _, _, want = torch.linalg.svd(a, full_matrices=False)
    _, _, got = torch.linalg.svd(a.to(remote), full_matrices=False)
    assert torch.equal(got.view(-1).cpu(), want.reshape(-1))
