"""Complex tensors on the remote device: ``.real``, ``.imag``, ``view_as_real`` and the
conjugate and negative views (Note [conjugate and negative views], djinn/frontend/meta.py).

``view_as_real`` (under ``.real``, ``.imag``, a complex ``fft`` read back as real, and the
rotary position embeddings of LLaMA-style models) and ``_neg_view`` (``z.conj().imag``)
were not on the appliance's allowlist: UNSUPPORTED_OP. And a remote ``z.conj()`` had no
conjugate bit on the client while the appliance's tensor had it, so ``z.conj().imag``
took the branch for an unconjugated tensor and the appliance refused its
``view_as_real``."""

from __future__ import annotations

import torch

R = "remote_accelerator:0"


def _z() -> torch.Tensor:
    return torch.randn(3, 4, dtype=torch.complex64, generator=torch.Generator().manual_seed(1))


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    return torch.equal(got.cpu().resolve_conj().resolve_neg(), want.resolve_conj().resolve_neg())


def test_real_and_imag_views_read_and_write_as_local_eager(remote):
    z = _z()
    rz = z.to(R)
    assert _same(rz.real + 1, z.real + 1)
    assert _same(rz.imag * 2, z.imag * 2)
    assert _same(torch.view_as_real(rz), torch.view_as_real(z))
    assert _same(torch.view_as_complex(torch.view_as_real(rz) * 3), z * 3)
    rz.real.mul_(2)  # a write through the view reaches the complex tensor
    z.real.mul_(2)
    assert _same(rz, z)
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(2))
    assert _same(torch.fft.ifft(torch.fft.fft(x.to(R))).real, torch.fft.ifft(torch.fft.fft(x)).real)


def test_conjugate_and_negative_bits_follow_local_eager(remote):
    z = _z()
    rz = z.to(R)
    assert rz.conj().is_conj() and not rz.conj().conj().is_conj()
    assert rz.conj().imag.is_neg() == z.conj().imag.is_neg()
    assert _same(rz.conj().imag, z.conj().imag)
    assert _same(rz.conj().real, z.conj().real)
    assert _same(rz.conj().imag.resolve_neg(), z.conj().imag.resolve_neg())
    assert _same(
        torch.view_as_real(rz.conj().resolve_conj()), torch.view_as_real(z.conj().resolve_conj())
    )
    assert _same(rz @ rz.mH, z @ z.mH)
    try:
        torch.view_as_real(z.conj())
    except RuntimeError as exc:
        want = str(exc)
    try:  # refused at capture, with eager's own error, as a local tensor is
        torch.view_as_real(rz.conj())
        raise AssertionError("view_as_real of a conjugated view did not raise")
    except RuntimeError as exc:
        assert str(exc) == want
    # moved in, a conjugated view is copied resolved, as local eager's copy is
    moved = z.conj().to(R)
    assert not moved.is_conj() and _same(moved, z.conj())
    assert _same(moved.imag, z.conj().imag)


def _rope(q: torch.Tensor) -> torch.Tensor:
    """LLaMA's rotary embedding: pairs of features as complex numbers, turned by position."""
    dev = q.device
    freqs = 1.0 / (10000 ** (torch.arange(0, 8, 2, device=dev).float() / 8))
    angles = torch.outer(torch.arange(q.shape[1], device=dev).float(), freqs)
    cis = torch.polar(torch.ones_like(angles), angles)
    qc = torch.view_as_complex(q.float().reshape(*q.shape[:-1], -1, 2))
    return torch.view_as_real(qc * cis).flatten(2)


def test_rotary_embeddings_and_their_gradient_match_local_eager(remote):
    q = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(3))
    rq = q.to(R).requires_grad_()
    lq = q.clone().requires_grad_()
    out, want = _rope(rq), _rope(lq)
    assert _same(out, want)
    out.pow(2).sum().backward()
    want.pow(2).sum().backward()
    assert _same(rq.grad, lq.grad)
    z = _z()
    rz = z.to(R).requires_grad_()
    lz = z.clone().requires_grad_()
    (rz.conj().imag * torch.arange(4.0).to(R)).sum().backward()
    (lz.conj().imag * torch.arange(4.0)).sum().backward()
    assert _same(rz.grad, lz.grad)
