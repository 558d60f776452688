"""Note [transformer fast path] (djinn/frontend/transformer_fastpath.py): in eval mode with
gradients off, ``nn.TransformerEncoder`` and ``nn.MultiheadAttention`` call PyTorch's fused
ops, which failed on the remote device with UNSUPPORTED_OP (every validation loop over a
transformer encoder). They now run the CPU body op for op: local eager's numbers."""

from __future__ import annotations

import copy

import pytest
import torch

from djinn.errors import UnsupportedOp

R = "remote_accelerator:0"


def _encoder(norm_first: bool, activation: str, nested: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(
        32, 4, 64, dropout=0.1, activation=activation, batch_first=True, norm_first=norm_first
    )
    return torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=nested).eval()


def _both(model: torch.nn.Module, run, grad_mode=torch.no_grad):
    """``run(model, device)`` locally and on the remote device (a copy of ``model``)."""
    remote = copy.deepcopy(model).to(R)
    with grad_mode():
        want = run(model, "cpu")
        got = run(remote, R)
    return got, want


X = torch.randn(3, 7, 32, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_an_encoder_in_evaluation_gives_local_eagers_numbers(
    remote, norm_first, activation, grad_mode
):
    got, want = _both(_encoder(norm_first, activation), lambda m, d: m(X.to(d)).cpu(), grad_mode)
    assert got.shape == want.shape and torch.equal(got, want), (got - want).abs().max()


def test_an_encoder_with_a_causal_mask_is_within_the_parity_bar(remote):
    """Masked, the softmax is masked_fill + softmax, whose sums round a few ulps away from
    eager's ``_masked_softmax`` kernel."""
    causal = torch.nn.Transformer.generate_square_subsequent_mask(7)
    got, want = _both(
        _encoder(False, "relu"), lambda m, d: m(X.to(d), mask=causal.to(d), is_causal=True).cpu()
    )
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_a_padding_mask_without_nested_tensors_is_within_the_parity_bar(remote):
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[1, 5:] = True
    pad[2, 2:] = True
    got, want = _both(
        _encoder(False, "relu"), lambda m, d: m(X.to(d), src_key_padding_mask=pad.to(d)).cpu()
    )
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_nested_tensors_are_refused_with_the_way_out(remote):
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[1, 5:] = True
    model = copy.deepcopy(_encoder(False, "relu", nested=True)).to(R)
    with torch.no_grad(), pytest.raises(UnsupportedOp, match="enable_nested_tensor=False"):
        model(X.to(R), src_key_padding_mask=pad.to(R)).cpu()
    with torch.no_grad():  # the session goes on
        assert model(X.to(R)).cpu().shape == (3, 7, 32)


@pytest.mark.parametrize("need_weights", [False, True])
def test_self_attention_in_evaluation_gives_eagers_output_and_weights(remote, need_weights):
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(48, 6, batch_first=True).eval()

    def run(m, d):
        x = torch.randn(3, 7, 48, generator=torch.Generator().manual_seed(2)).to(d)
        out, weights = m(x, x, x, need_weights=need_weights)  # one tensor: the fast path
        return out.cpu(), None if weights is None else weights.cpu()

    (out, weights), (want_out, want_weights) = _both(mha, run)
    assert torch.equal(out, want_out), (out - want_out).abs().max()
    if need_weights:
        assert torch.equal(weights, want_weights)
    else:
        assert weights is None and want_weights is None


def test_a_validation_loop_after_training_steps_runs(remote):
    torch.manual_seed(0)
    model = torch.nn.Sequential(_encoder(False, "gelu"), torch.nn.Linear(32, 1))
    local, moved = model, copy.deepcopy(model).to(R)
    for m, d in ((local, "cpu"), (moved, R)):
        torch.manual_seed(3)  # the same dropout draws in both loops
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        m.train()
        for _ in range(2):
            opt.zero_grad()
            m(X.to(d)).pow(2).mean().backward()
            opt.step()
        m.eval()
    with torch.no_grad():
        want = local(X)
        got = moved(X.to(R)).cpu()
    assert torch.equal(got, want), (got - want).abs().max()


def test_a_row_with_every_position_masked_is_nan_as_in_eager(remote):
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(32, 4, batch_first=True).eval()
    mask = torch.zeros(7, 7, dtype=torch.bool)
    mask[0] = True  # the first query may attend to nothing

    def run(m, d):
        x = X.to(d)
        return m(x, x, x, attn_mask=mask.to(d), need_weights=False)[0].cpu()

    got, want = _both(mha, run)
    assert want[:, 0].isnan().all() and got[:, 0].isnan().all()
    torch.testing.assert_close(got[:, 1:], want[:, 1:], rtol=0, atol=1e-5)


def test_a_float64_encoder_gives_local_eagers_numbers(remote):
    model = _encoder(False, "relu").double()
    got, want = _both(model, lambda m, d: m(X.double().to(d)).cpu())
    assert torch.equal(got, want), (got - want).abs().max()


def test_a_transformers_padding_mask_names_its_own_switch(remote):
    torch.manual_seed(0)
    model = torch.nn.Transformer(32, 4, 1, 1, 64, dropout=0.0, batch_first=True).eval()
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[1, 5:] = True
    remote_model = copy.deepcopy(model).to(R)
    with torch.no_grad(), pytest.raises(UnsupportedOp, match=r"encoder\.use_nested_tensor"):
        remote_model(X.to(R), X.to(R), src_key_padding_mask=pad.to(R)).cpu()
    model.encoder.use_nested_tensor = remote_model.encoder.use_nested_tensor = False
    with torch.no_grad():
        want = model(X, X, src_key_padding_mask=pad)
        got = remote_model(X.to(R), X.to(R), src_key_padding_mask=pad.to(R)).cpu()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
