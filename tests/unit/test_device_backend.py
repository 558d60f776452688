"""Pins the PyTorch behaviour the remote device relies on (Note [python backend]).

If a PyTorch upgrade breaks one of these, the capture frontend breaks with it: these
tests say which assumption moved. None of them needs an appliance.
"""

from __future__ import annotations

import torch

import djinn  # noqa: F401 - registers the backend
from djinn.frontend.device import DEVICE_TYPE, is_remote
from djinn.frontend.extension_points import device
from djinn.frontend.lazy import LazyTensor, Uninit


def test_device_strings_are_legal():
    assert torch.device("remote_accelerator", 0).type == DEVICE_TYPE
    assert torch.device("remote_accelerator:1").index == 1
    assert device(0) == torch.device("remote_accelerator:0")
    assert is_remote("remote_accelerator:0") and is_remote(torch.device("remote_accelerator"))
    assert not is_remote("cpu")


def test_factories_reach_the_privateuse1_fallback_as_lazy_empties():
    t = torch.empty(3, 4, device="remote_accelerator:0")
    assert isinstance(t, LazyTensor) and isinstance(t._ref, Uninit)
    assert t.shape == (3, 4) and t.device.type == DEVICE_TYPE


def test_module_to_turns_parameters_into_lazy_parameters():
    lin = torch.nn.Linear(3, 2)
    assert lin.weight.device.type == "cpu"
    # .to() uploads (needs an appliance), so only check the parameter conversion path:
    # Parameter() of a wrapper subclass keeps the subclass and marks it as a parameter.
    p = torch.nn.Parameter(torch.empty(2, 3, device="remote_accelerator:0"))
    assert isinstance(p, LazyTensor) and getattr(p, "_is_param", False)


def test_capture_needs_no_meta_run_for_a_cached_signature():
    from djinn.frontend import meta

    x = torch.empty(5, 5, device="remote_accelerator:0")
    _ = x + x
    size = meta.cache_size()
    _ = x + x
    assert meta.cache_size() == size


def test_a_pointwise_op_keys_its_scalars_by_kind_and_a_shape_op_by_value():
    """Note [pointwise keys]: an optimizer's new float every step reuses one cache entry;
    the scalar's kind still decides the dtype, and where a value decides a shape (arange's
    step, a view's sizes) it is still part of the key."""
    from djinn.frontend import meta

    x = torch.empty(5, 5, device="remote_accelerator:0")
    i = torch.empty(5, 5, dtype=torch.long, device="remote_accelerator:0")
    _ = x.div(0.5)
    size = meta.cache_size()
    for k in range(20):
        assert x.div(1.0 + k / 7).dtype == torch.float32
    assert meta.cache_size() == size
    assert (i * 2).dtype == torch.long and (i * 3).dtype == torch.long
    assert (i * 2.5).dtype == torch.float32  # a float: another kind, another entry
    assert (i * True).dtype == torch.long
    assert x.view(25).shape == (25,) and x.view(1, 25).shape == (1, 25)
    for step in (0.5, 0.25, 1.0):
        n = int(4 / step)
        assert torch.arange(0, 4, step, device="remote_accelerator:0").shape == (n,)


def test_a_foreach_op_keys_its_scalar_lists_by_kind():
    """Note [pointwise keys] for the ``_foreach_*`` forms, which PyTorch does not tag
    pointwise: Adam(foreach=True)'s per-step bias corrections (a new ScalarList each step)
    reuse one cache entry, and an integer list's results keep their dtype."""
    from djinn.frontend import meta

    xs = [torch.empty(3, 4, device="remote_accelerator:0") for _ in range(3)]
    ints = [torch.empty(2, dtype=torch.long, device="remote_accelerator:0") for _ in range(2)]
    torch._foreach_div_(xs, [1.5, 2.5, 3.5])
    outs = torch._foreach_mul(xs, [0.5, 0.25, 0.125])
    size = meta.cache_size()
    for step in range(2, 12):
        torch._foreach_div_(xs, [1.0 - 0.9**step] * 3)
        outs = torch._foreach_mul(xs, [step / 3.0] * 3)
    assert meta.cache_size() == size
    assert [(o.shape, o.dtype) for o in outs] == [((3, 4), torch.float32)] * 3
    assert [o.dtype for o in torch._foreach_mul(ints, [2, 3])] == [torch.long] * 2
    assert [o.dtype for o in torch._foreach_mul(ints, [2.5, 3.5])] == [torch.float32] * 2


def test_an_op_that_returns_nothing_is_inferred_once(monkeypatch):
    """An in-place foreach op's spec is None: it must still count as cached, not be
    inferred on meta again at every capture."""
    from djinn.frontend import meta

    xs = [torch.empty(3, 4, device="remote_accelerator:0") for _ in range(3)]
    ys = [torch.empty(3, 4, device="remote_accelerator:0") for _ in range(3)]
    torch._foreach_addcdiv_(xs, ys, ys, [0.5, 0.25, 0.125])
    ran: list[object] = []
    real = meta._spec
    monkeypatch.setattr(meta, "_spec", lambda out, flat: ran.append(out) or real(out, flat))
    for step in range(5):
        torch._foreach_addcdiv_(xs, ys, ys, [step / 3.0] * 3)
        torch._foreach_lerp_(xs, ys, 0.1 * step)
    assert ran == [None]  # the lerp, once; the addcdiv not at all


def test_remote_parameters_get_the_foreach_default_as_on_cuda():
    """Note [foreach by default]: PyTorch's optimizers and ``clip_grad_norm_`` take their
    foreach path for parameters of the remote device, as for CUDA's; CPU ones keep theirs."""
    from torch.optim.optimizer import _default_to_fused_or_foreach
    from torch.utils._foreach_utils import _has_foreach_support

    remote = [torch.nn.Parameter(torch.empty(2, 3, device="remote_accelerator:0"))]
    local = [torch.nn.Parameter(torch.empty(2, 3))]
    assert _default_to_fused_or_foreach(remote, False, False) == (False, True)
    assert _default_to_fused_or_foreach(local, False, False) == (False, False)
    assert _has_foreach_support(remote, remote[0].device)
