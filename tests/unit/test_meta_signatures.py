"""Note [meta signatures]: the worker's meta check reuses the verdict for arguments it has
seen, and only for arguments that would give the same verdict."""

from __future__ import annotations

import contextlib

import pytest
import torch

from djinn.appliance.executor import metacheck
from djinn.errors import ExecutionError

aten = torch.ops.aten


@pytest.fixture
def runs(monkeypatch):
    calls: list[object] = []
    real = metacheck.meta_run

    def counting(op, args, kwargs):
        calls.append(op)
        return real(op, args, kwargs)

    monkeypatch.setattr(metacheck, "meta_run", counting)
    monkeypatch.setattr(metacheck, "_cache", type(metacheck._cache)())
    return calls


def test_a_repeated_signature_reuses_the_verdict(runs):
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    first = metacheck.checked_run(aten.mm.default, [a, b], {})
    again = metacheck.checked_run(aten.mm.default, [torch.randn(4, 8), torch.randn(8, 3)], {})
    assert len(runs) == 1
    assert first[0] == again[0] == 4 * 3 * 4
    assert again[1].shape == (4, 3) and again[1].dtype == torch.float32


@pytest.mark.parametrize(
    "other",
    [
        lambda a: [a.t().contiguous().t(), 2.0],  # other strides
        lambda a: [a.double(), 2.0],  # other dtype
        lambda a: [a[1:], 2.0],  # other offset and sizes
        lambda a: [a, 2],  # an int, not a float
        lambda a: [a, True],  # a bool
    ],
)
def test_anything_the_meta_kernel_sees_is_part_of_the_signature(runs, other):
    a = torch.randn(4, 4)
    metacheck.checked_run(aten.mul.Tensor, [a, 2.0], {})
    metacheck.checked_run(aten.mul.Tensor, other(torch.randn(4, 4)), {})
    assert len(runs) == 2


def test_a_numbers_value_is_part_of_the_signature_where_it_may_decide_a_shape(runs):
    a = metacheck.checked_run(aten.arange.start_step, [0.0, 4.0, 1.0], {"dtype": torch.float32})
    b = metacheck.checked_run(aten.arange.start_step, [0.0, 8.0, 1.0], {"dtype": torch.float32})
    assert len(runs) == 2 and a[1].shape == (4,) and b[1].shape == (8,)


def test_pointwise_and_foreach_ops_key_numbers_by_kind(runs):
    """Note [number-free signatures]: Adam's new step sizes every step reuse the verdict."""
    a, b = torch.randn(4), torch.randn(3)
    metacheck.checked_run(aten.mul.Tensor, [a, 2.0], {})
    metacheck.checked_run(aten.mul.Tensor, [torch.randn(4), 3.5], {})
    assert len(runs) == 1
    for step in (0.1, 0.2, 0.3):
        metacheck.checked_run(aten._foreach_mul_.ScalarList, [[a, b], [step, -step]], {})
    assert len(runs) == 2
    metacheck.checked_run(aten._foreach_mul_.ScalarList, [[a, b], [1, 2]], {})  # ints
    assert len(runs) == 3


def test_a_value_check_a_reused_verdict_skips_is_the_real_kernels():
    from djinn.appliance.executor.graph import GraphRun
    from djinn.appliance.vmu.device import DeviceVMU

    ints = torch.arange(4)

    def pow_(exponent):
        node = {"op": "aten::pow.Tensor_Scalar", "args": [{"$h": "i"}, exponent]}
        body = {"nodes": [node], "keep": [], "fetch": [{"$v": 0}]}
        stack = DeviceVMU(1 << 20)["stack"]
        return GraphRun(body, {"i": ints}.__getitem__, [], torch.device("cpu"), stack).run()

    assert torch.equal(pow_(2)[1][0], ints**2)
    with pytest.raises(ExecutionError, match="negative integer powers"):
        pow_(-1)


def test_shared_storage_is_part_of_the_signature(runs):
    # the same views, once of three storages and once of one: the in-place and overlap
    # checks of the kernel see different arguments, so the verdict is not reused
    x, y, z = torch.randn(8), torch.randn(8), torch.randn(8)
    metacheck.checked_run(aten.add.out, [x[:4], y[2:6]], {"out": z[1:5]})
    base = torch.randn(8)
    # whether PyTorch refuses the overlap is its business; it must have been asked
    with contextlib.suppress(ExecutionError):
        metacheck.checked_run(aten.add.out, [base[:4], base[2:6]], {"out": base[1:5]})
    assert len(runs) == 2


def test_a_refusal_is_not_cached(runs):
    for _ in range(2):
        with pytest.raises(ExecutionError):
            metacheck.checked_run(aten.mm.default, [torch.randn(2, 3), torch.randn(4, 5)], {})
    assert len(runs) == 2
    assert metacheck.cache_size() == 0


def test_the_cache_is_bounded(runs, monkeypatch):
    monkeypatch.setattr(metacheck, "CACHE_ENTRIES", 3)
    for n in range(1, 6):
        metacheck.checked_run(aten.neg.default, [torch.randn(n)], {})
    assert metacheck.cache_size() == 3
