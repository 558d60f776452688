"""Custom ops written with ``torch.library.custom_op`` on the remote device (Note [custom
ops], djinn/frontend/custom_ops.py): an op whose body serves every device runs that body
on the remote tensors, its ``register_autograd`` formula giving the gradient; one with
bodies for named devices only stays a typed refusal. Both were refused ("not an
aten/prims op name")."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from djinn.errors import DjinnError

R = "remote_accelerator:0"


@torch.library.custom_op("djinn_test::scaled_gelu", mutates_args=())
def scaled_gelu(x: torch.Tensor, scale: float) -> torch.Tensor:
    return F.gelu(x) * scale


@scaled_gelu.register_fake
def _(x, scale):
    return torch.empty_like(x)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.scale = inputs[1]


def _backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return torch.ops.aten.gelu_backward(grad, x) * ctx.scale, None


scaled_gelu.register_autograd(_backward, setup_context=_setup)


@torch.library.custom_op("djinn_test::add_into", mutates_args=("out",))
def add_into(out: torch.Tensor, x: torch.Tensor) -> None:
    out.add_(x * 2)


@torch.library.custom_op("djinn_test::cpu_double", mutates_args=(), device_types="cpu")
def cpu_double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@cpu_double.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("djinn_test::cpu_triple", mutates_args=(), device_types="cpu")
def cpu_triple(x: torch.Tensor) -> torch.Tensor:  # no fake kernel either
    return x * 3


def _x() -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(0))


def test_a_custom_op_for_every_device_runs_its_body_with_its_own_gradient(remote):
    local = _x().requires_grad_()
    moved = _x().to(R).requires_grad_()
    want, got = scaled_gelu(local, 3.0), scaled_gelu(moved, 3.0)
    assert torch.equal(got.cpu(), want)
    (want * torch.arange(6.0)).sum().backward()
    (got * torch.arange(6.0).to(R)).sum().backward()
    assert torch.equal(moved.grad.cpu(), local.grad)
    out, rout = torch.ones(4, 6), torch.ones(4, 6).to(R)
    add_into(out, _x())
    add_into(rout, _x().to(R))
    assert torch.equal(rout.cpu(), out)


def test_a_custom_op_for_named_devices_only_is_refused_typed(remote):
    with pytest.raises(DjinnError, match="djinn_test::cpu_double"):
        cpu_double(_x().to(R)).cpu()
    with pytest.raises(DjinnError, match="djinn_test::cpu_triple"):  # was an untyped error
        cpu_triple(_x().to(R))
    assert (torch.ones(2, device=R) + 1).cpu().tolist() == [2.0, 2.0]  # the session goes on
