"""A remote tensor's shape changed in place (Note [shapes changed in place],
djinn/frontend/inplace_views.py): ``unsqueeze_``, ``squeeze_``, ``t_``, ``transpose_``,
``as_strided_`` were refused ("changes the shape of a remote tensor in place"), and so was
``torch.quantile``, whose composite code squeezes its own sorted copy in place."""

from __future__ import annotations

import torch

R = "remote_accelerator:0"


def _b() -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(0))


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    assert torch.equal(got.cpu(), want)


def test_shapes_changed_in_place_follow_local_eager(remote):
    def run(device: str) -> list[torch.Tensor]:
        x = _b().to(device)
        before = x[0]  # a view taken before keeps its shape
        x.unsqueeze_(0)
        x.transpose_(1, 2)
        doubled = x * 2
        x.squeeze_(0)
        x.t_()
        x.add_(1)  # still the same storage: the view taken before sees it
        x.unsqueeze_(-1)
        x.squeeze_((2,))
        return [x, before, doubled, x.contiguous()]

    for got, want in zip(run(R), run("cpu"), strict=True):
        _same(got, want)
        assert got.stride() == want.stride()
    x, y = _b(), _b().to(R)
    x.as_strided_((2, 3), (6, 2), 1)
    y.as_strided_((2, 3), (6, 2), 1)
    assert (y.shape, y.stride(), y.storage_offset()) == ((2, 3), (6, 2), 1)
    _same(y + 1, x + 1)


def test_quantile_and_gradients_through_an_in_place_shape_change(remote):
    x, rx = _b(), _b().to(R)
    _same(rx.quantile(0.3), x.quantile(0.3))
    q = torch.tensor([0.2, 0.7])
    _same(rx.quantile(q.to(R), dim=1), x.quantile(q, dim=1))
    _same(rx.nanquantile(0.5, dim=0, keepdim=True), x.nanquantile(0.5, dim=0, keepdim=True))
    _same(
        torch.quantile(rx, 0.5, interpolation="nearest"),
        torch.quantile(x, 0.5, interpolation="nearest"),
    )

    def grad(device: str) -> torch.Tensor:
        a = _b().to(device).requires_grad_()
        y = a * 2
        y.unsqueeze_(0)
        (y * torch.arange(6.0).to(device)).sum().backward()
        a.quantile(0.3).backward()
        return a.grad

    _same(grad(R), grad("cpu"))
    leaf = _b().to(R).requires_grad_()
    try:  # autograd's own refusal, above the device
        leaf.unsqueeze_(0)
        raise AssertionError("an in-place op on a leaf that requires grad did not raise")
    except RuntimeError as exc:
        assert "leaf Variable that requires grad" in str(exc)
