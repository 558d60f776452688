"""``torch.tril_indices`` and ``triu_indices`` made on the remote device: they were not on
the appliance's allowlist (UNSUPPORTED_OP), so code that builds a triangular mask's
indices on the device (pairwise losses, attention biases) could not run there."""

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
