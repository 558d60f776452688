"""``F.interpolate(..., antialias=True)`` trains on the remote device with local eager's
numbers, bicubic as bilinear (``_upsample_bicubic2d_aa`` was UNSUPPORTED_OP: a review)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

R = "remote_accelerator:0"


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
@pytest.mark.parametrize("size", [(5, 7), (19, 23)], ids=["down", "up"])
def test_antialiased_resize_and_its_gradient_are_local_eagers(remote, mode, size):
    image = torch.randn(2, 3, 11, 13, generator=torch.Generator().manual_seed(0))
    results = []
    for device in ("cpu", R):
        x = image.clone().to(device).requires_grad_()
        y = F.interpolate(x, size=size, mode=mode, antialias=True, align_corners=False)
        (y * y).sum().backward()
        results.append((y.detach().cpu(), x.grad.cpu()))
    (want, want_grad), (got, got_grad) = results
    assert torch.equal(got, want) and torch.equal(got_grad, want_grad)
