"""Note [composite ops under inference mode]: torch.inference_mode() skips the autograd
keys, where composite ops (linear, layer_norm, attention...) are decomposed; remote code
under it runs as it does under no_grad, with local eager's numbers."""

from __future__ import annotations

import torch


def test_a_model_runs_under_inference_mode_with_local_eagers_numbers(remote):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4)
    ).eval()
    x = torch.randn(8, 16)
    with torch.inference_mode():
        want = model(x)
    remote_model = torch.nn.Sequential(*(m for m in model)).train().to(remote).eval()
    with torch.inference_mode():
        got = remote_model(x.to(remote)).cpu()  # linear arrived whole: UNSUPPORTED_OP
    assert (got - want).abs().max().item() <= 1e-5


def test_softmax_under_inference_mode_still_runs_as_one_op(remote):
    x = torch.randn(4, 6)
    with torch.inference_mode():
        got = torch.softmax(x.to(remote), -1).cpu()
    assert torch.equal(got, torch.softmax(x, -1))
