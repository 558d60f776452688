"""Note [one-hot layout] (djinn/frontend/one_hot.py): ``F.one_hot`` of a transposed
index is contiguous, as local eager's, so ``.view(-1)`` works (it raised "view size is
not compatible" on the remote device, whose composite body kept the index's strides)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

R = "remote_accelerator:0"


def test_one_hot_has_local_eagers_values_and_layout(remote):
    index = torch.tensor([[0, 1, 2], [3, 4, 5]]).T
    for args in [(), (8,)]:
        got, want = F.one_hot(index.to(R), *args), F.one_hot(index, *args)
        assert got.stride() == want.stride() and got.is_contiguous()
        assert torch.equal(got.view(-1).cpu(), want.view(-1))
    assert F.one_hot(torch.tensor([], dtype=torch.long).to(R), 3).shape == (0, 3)
    torch.manual_seed(0)
    probs = torch.ones(3, 4) / 4
    want = torch.distributions.OneHotCategorical(probs=probs).sample((2,))
    torch.manual_seed(0)
    got = torch.distributions.OneHotCategorical(probs=probs.to(R)).sample((2,))
    assert got.stride() == want.stride()
    assert torch.equal(got.view(-1).cpu(), want.view(-1))


def test_one_hot_refuses_what_eager_refuses_as_a_runtime_error(remote):
    with pytest.raises(RuntimeError, match="index tensor of type LongTensor"):
        F.one_hot(torch.tensor([1.0]).to(R), 3)
    with pytest.raises(RuntimeError, match="out of bounds"):  # eager: at the call
        F.one_hot(torch.tensor([1, 7]).to(R), 3).cpu()
