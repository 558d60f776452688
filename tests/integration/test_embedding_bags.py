"""Note [embedding bags] (djinn/frontend/embedding_bag.py): nn.EmbeddingBag whose weight
trains runs on the remote device with local eager's numbers (it was UNSUPPORTED_OP:
``aten::_embedding_bag``), and the appliance still runs no kernel that indexes by what a
client could forge."""

from __future__ import annotations

import pytest
import torch

from djinn.errors import DjinnError, UnsupportedOp

R = "remote_accelerator:0"


def _train(device: str, steps: int = 3, n: int = 40, dtype=torch.int64, **bag) -> tuple:
    """A few Adam steps of a bag and a head; the bag's weight, its last gradient, the
    per-sample weights' gradient and the last loss."""
    torch.manual_seed(0)
    model = torch.nn.EmbeddingBag(50, 8, **{k: v for k, v in bag.items() if k != "psw"})
    head = torch.nn.Linear(8, 1)
    model, head = model.to(device), head.to(device)
    opt = torch.optim.Adam([*model.parameters(), *head.parameters()], lr=0.1)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 50, (n,), generator=g)
    ids[:4] = 2  # a repeated index, and the padding row where there is one
    offsets = torch.tensor([0, 5, 5, 17, n // 2])  # an empty bag among them
    if bag.get("include_last_offset"):
        offsets = torch.cat([offsets, torch.tensor([n])])
    psw = torch.rand(n, generator=g).requires_grad_() if bag.get("psw") else None
    for _ in range(steps):
        weights = None if psw is None else psw.to(device)
        out = model(ids.to(dtype).to(device), offsets.to(dtype).to(device), weights)
        loss = (head(out) ** 2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    pgrad = None if psw is None else psw.grad.clone()
    return model.weight.detach().cpu(), model.weight.grad.cpu(), pgrad, loss.item()


EXACT = [
    {"mode": "sum"},
    {"mode": "sum", "padding_idx": 2, "include_last_offset": True},
    {"mode": "max"},
    {"mode": "max", "padding_idx": 2},
]
SCALED = [  # the kernel multiplies inside a BLAS axpy: within a rounding
    {"mode": "mean"},
    {"mode": "mean", "padding_idx": 2, "include_last_offset": True},
    {"mode": "sum", "scale_grad_by_freq": True},
    {"mode": "mean", "scale_grad_by_freq": True, "padding_idx": 2},
    {"mode": "sum", "psw": True},
    {"mode": "sum", "psw": True, "scale_grad_by_freq": True, "padding_idx": 2},
]


@pytest.mark.parametrize("bag", EXACT, ids=str)
def test_sum_and_max_bags_train_with_local_eagers_bits(remote, bag):
    got, want = _train(R, **bag), _train("cpu", **bag)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[3] == want[3]


@pytest.mark.parametrize("bag", SCALED, ids=str)
def test_scaled_bags_train_within_rounding_of_local_eager(remote, bag):
    """scale_grad_by_freq included: PyTorch's CPU kernel divides a run of equal sorted
    indices by another index's count, and so does the capture (eager's numbers)."""
    got, want = _train(R, **bag), _train("cpu", **bag)
    for a, b in zip(got[:3], want[:3], strict=True):
        if b is not None:
            assert (a - b).abs().max().item() <= 1e-6
    assert abs(got[3] - want[3]) <= 1e-5 * max(1.0, abs(want[3]))


def test_past_the_kernels_parallel_threshold_and_with_int32_indices(remote):
    bag = {"mode": "sum", "n": 5000, "steps": 1}
    assert torch.equal(_train(R, **bag)[1], _train("cpu", **bag)[1])
    bag = {"mode": "mean", "dtype": torch.int32, "padding_idx": 2}
    got, want = _train(R, **bag), _train("cpu", **bag)
    assert (got[1] - want[1]).abs().max().item() <= 1e-6


def test_two_dimensional_input_without_offsets(remote):
    def grad(device: str) -> torch.Tensor:
        torch.manual_seed(0)
        model = torch.nn.EmbeddingBag(30, 4, mode="max").to(device)
        ids = torch.randint(0, 30, (6, 5), generator=torch.Generator().manual_seed(2))
        model(ids.to(device)).pow(2).sum().backward()
        return model.weight.grad.cpu()

    assert torch.equal(grad(R), grad("cpu"))


def test_sparse_bags_and_forged_offsets_are_refused_typed_and_the_session_goes_on(remote):
    model = torch.nn.EmbeddingBag(10, 4, sparse=True).to(R)
    with pytest.raises(UnsupportedOp, match="sparse=True"):
        model(torch.tensor([1, 2, 3]).to(R), torch.tensor([0, 2]).to(R))
    model = torch.nn.EmbeddingBag(10, 4, mode="sum").to(R)
    ids = torch.tensor([1, 2, 3]).to(R)
    with pytest.raises(DjinnError, match="offsets"):  # eager raises at the call
        model(ids, torch.tensor([0, 7]).to(R)).sum().backward()
        model.weight.grad.cpu()  # here at the read
    model.zero_grad()
    out = model(ids, torch.tensor([0, 2]).to(R))
    out.sum().backward()
    assert model.weight.grad.cpu()[1:4].eq(1).all()


def test_the_appliance_still_refuses_the_bag_kernels_a_client_could_feed_forged_indices():
    from appliance.executor import oppolicy

    for name in ("_embedding_bag", "_embedding_bag_backward", "_embedding_bag_dense_backward"):
        assert not oppolicy.allowed(getattr(torch.ops.aten, name).default), name
    assert not oppolicy.allowed(torch.ops.aten._embedding_bag_per_sample_weights_backward.default)
