"""Note [embedding backward] (djinn/frontend/embedding.py): backward through nn.Embedding on
the remote device gives local eager's weight gradient (it was UNSUPPORTED_OP), so GPT-2, its
embedding tied to its head (Note [tied parameters]), trains on the graph path with local
eager's numbers."""

from __future__ import annotations

import pytest
import torch

R = "remote_accelerator:0"


def _grads(device: str, n_ids: int, **emb_kwargs) -> torch.Tensor:
    torch.manual_seed(0)
    emb = torch.nn.Embedding(50, 8, **emb_kwargs)
    ids = torch.randint(0, 50, (n_ids,), generator=torch.Generator().manual_seed(1))
    ids[:3] = 7  # a repeated index, and the padding row below
    out = emb.to(device)(ids.to(device))
    (out * torch.arange(8.0).to(device)).sum().backward()
    return emb.weight.grad.cpu()


@pytest.mark.parametrize("emb_kwargs", [{}, {"padding_idx": 7}], ids=str)
def test_the_weight_gradient_is_local_eagers(remote, emb_kwargs):
    got, want = _grads(R, 64, **emb_kwargs), _grads("cpu", 64, **emb_kwargs)
    assert torch.equal(got, want)  # summed in index order, as the kernel does


def test_scaled_by_frequency_it_is_within_rounding(remote):
    got, want = _grads(R, 64, scale_grad_by_freq=True), _grads("cpu", 64, scale_grad_by_freq=True)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)  # divided first, not scaled after


@pytest.mark.parametrize("n_ids", [5000, 100_000])
def test_past_the_parallel_threshold_it_is_still_the_kernels_to_the_bit(remote, n_ids):
    assert torch.equal(_grads(R, n_ids), _grads("cpu", n_ids))  # index_put would not be


def test_int32_indices_of_any_shape_give_the_kernels_gradient(remote):
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (3, 4, 5), generator=torch.Generator().manual_seed(3))

    def grad(device: str) -> torch.Tensor:
        emb = torch.nn.Embedding(50, 8, padding_idx=-3)
        emb.weight.data.copy_(torch.arange(400.0).reshape(50, 8))
        emb = emb.to(device)
        out = emb(ids.to(torch.int32).to(device))
        (out * out).sum().backward()
        return emb.weight.grad.cpu()

    assert torch.equal(grad(R), grad("cpu"))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reduced_precision_sums_as_cuda_does_within_the_dtypes_rounding(remote, dtype):
    """float32 accumulation (CUDA's kernel); the CPU kernel rounds after each add."""
    ids = torch.randint(0, 20, (200,), generator=torch.Generator().manual_seed(4))
    grad = torch.randn(200, 8, generator=torch.Generator().manual_seed(5)).to(dtype)
    args = (ids, 20, -1, False)
    got = torch.ops.aten.embedding_dense_backward(grad.to(R), ids.to(R), *args[1:]).cpu()
    exact = torch.ops.aten.embedding_dense_backward(grad.double(), *args)
    assert torch.equal(got, exact.to(dtype))  # one rounding of the exact sum, here
    eager = torch.ops.aten.embedding_dense_backward(grad, *args)
    assert torch.allclose(got.float(), eager.float(), rtol=0.05, atol=0.05)


def test_scaled_by_frequency_counts_past_what_half_precision_counts(remote):
    ids = torch.zeros(4000, dtype=torch.long)  # one row, 4,000 times: float16 counts stop at 2048
    grad = torch.ones(4000, 2, dtype=torch.float16)
    got = torch.ops.aten.embedding_dense_backward(grad.to(R), ids.to(R), 3, -1, True).cpu()
    assert torch.equal(got[0], torch.ones(2, dtype=torch.float16))  # 4,000 x (1 / 4,000)


def test_an_index_out_of_range_fails_the_op_and_the_session_goes_on(remote):
    """The kernel would write outside its allocation (no bounds check): the decomposition's
    ``index_add`` checks, so the gradient fails with a typed error instead."""
    from djinn.errors import DjinnError

    grad = torch.ones(3, 2).to(R)
    ids = torch.tensor([0, 9, 1]).to(R)
    out = torch.ops.aten.embedding_dense_backward(grad, ids, 4, -1, False)
    with pytest.raises(DjinnError, match="out of bounds"):
        out.cpu()
    assert torch.equal((grad * 2).cpu(), torch.full((3, 2), 2.0))


def test_gpt2_trains_on_the_graph_path_with_local_eagers_numbers(remote):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(2))

    def step(device: str) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = GPT2LMHeadModel(config).train().to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            opt.zero_grad()
            model(ids.to(device), labels=ids.to(device)).loss.backward()
            opt.step()
        return [p.detach().cpu() for p in model.parameters()]

    for got, want in zip(step(R), step("cpu"), strict=True):
        assert (got - want).abs().max().item() <= 1e-5


def test_a_sparse_gradient_is_refused_at_the_forward_typed(remote):
    """Note [sparse embeddings]: before, backward() finished and SparseAdam raised its own
    "does not support dense gradients" on the wrapper that held the refusal."""
    from djinn.errors import UnsupportedOp

    torch.manual_seed(0)
    local = torch.nn.Embedding(10, 3, sparse=True)
    emb = torch.nn.Embedding(10, 3, sparse=True)
    emb.load_state_dict(local.state_dict())
    emb = emb.to(R)
    ids = torch.tensor([1, 2, 2])
    with pytest.raises(UnsupportedOp, match=r"sparse=True.*Note \[sparse embeddings\]"):
        emb(ids.to(R))
    with torch.no_grad():  # no gradient to make: it runs, as a frozen table does
        assert torch.equal(emb(ids.to(R)).cpu(), local(ids))
    emb.weight.requires_grad_(False)
    assert torch.equal(emb(ids.to(R)).cpu(), local(ids).detach())
