"""Note [meta strides] (appliance/executor/graph.py): a kernel that lays out a new tensor
otherwise than the meta kernel the client asked (the CPU convolution answers a
channels-last input with a channels-last output; meta says contiguous) has its output
copied into the layout the client was told. Before, a view the client decided on its
strides read other elements on the worker, and the group norm after it refused its input
there (a review: diffusers' UNet2DModel in eval mode failed every forward)."""

from __future__ import annotations

import copy

import torch


def _convolved(conv: torch.nn.Module, norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    h = conv(x)
    return norm(h.view(2, 32, 16)).transpose(1, 2) + h.flatten(2).transpose(1, 2)


def test_a_convolution_of_a_channels_last_input_is_laid_out_as_the_client_was_told(remote):
    torch.manual_seed(0)
    conv, norm = torch.nn.Conv2d(64, 32, 3, padding=1), torch.nn.GroupNorm(8, 32)
    x = torch.randn(2, 64, 4, 4).to(memory_format=torch.channels_last)
    with torch.no_grad():
        want = _convolved(conv, norm, x)
        moved = [copy.deepcopy(m).to(remote) for m in (conv, norm)]
        got = _convolved(*moved, x.to(remote))
        assert (got.cpu() - want).abs().max().item() <= 1e-5
    # in training too, with the gradients
    local = [copy.deepcopy(m) for m in (conv, norm)]
    moved = [copy.deepcopy(m).to(remote) for m in (conv, norm)]
    _convolved(*local, x).square().sum().backward()
    _convolved(*moved, x.to(remote)).square().sum().backward()
    for a, b in zip(moved, local, strict=True):
        for p, q in zip(a.parameters(), b.parameters(), strict=True):
            assert (p.grad.cpu() - q.grad).abs().max().item() <= 1e-4 * q.grad.abs().max().item()
