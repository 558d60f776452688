"""PyTorch's ``out=`` factories resize their target first (``torch.zeros(3, out=buf)``,
``torch.arange(n, out=buf)``, ``torch.randn``); the appliance runs no ``resize_``, and each
was refused (a review). A resize to the size the target has is eager's no-op; another
size is still refused, typed."""

from __future__ import annotations

import pytest
import torch

from djinn.errors import UnsupportedOp

FILLS = {
    "zeros": lambda out: torch.zeros(3, 2, out=out),
    "full": lambda out: torch.full((3, 2), 7.0, out=out),
    "randn": lambda out: torch.randn(3, 2, out=out),
    "rand with a generator": lambda out: torch.rand(
        3, 2, out=out, generator=torch.Generator().manual_seed(4)
    ),
    "arange": lambda out: torch.arange(6.0, out=out),
    "linspace": lambda out: torch.linspace(0, 1, 6, out=out),
}


@pytest.mark.parametrize("moved", [False, True], ids=["made there", "moved in"])
@pytest.mark.parametrize("name", FILLS)
def test_an_out_factory_fills_its_target_as_in_eager(remote, name, moved):
    def target(device: str) -> torch.Tensor:
        made = torch.empty(6) if name in ("arange", "linspace") else torch.empty(2, 3).t()
        if device == "cpu":
            return made  # the second: not contiguous, and its strides stay
        return made.to(device) if moved else torch.empty_like(made, device=device)

    torch.manual_seed(0)
    want = FILLS[name](target("cpu"))
    torch.manual_seed(0)
    got = FILLS[name](target(remote))
    assert got.stride() == want.stride()
    assert torch.equal(got.cpu(), want)


def test_an_out_factory_into_a_target_of_another_size_is_refused(remote):
    with pytest.raises(UnsupportedOp, match="resize_"):
        torch.randn(5, out=torch.empty(0, device=remote)).cpu()


def test_a_resize_to_another_size_is_refused_at_the_call(remote):
    """It was captured and refused by the appliance, so an empty tensor's ``resize_`` met
    its error at the next read, lines later (a hunt)."""
    for start in (torch.empty(0, device=remote), torch.ones(4, device=remote)):
        with pytest.raises(UnsupportedOp, match="resize_"):
            start.resize_(2, 3)
    x = torch.ones(2, 3, device=remote)
    assert x.resize_(2, 3) is x and x.cpu().tolist() == [[1.0] * 3] * 2  # eager's no-op
    assert x.resize_((2, 3), memory_format=torch.contiguous_format) is x  # so is this
