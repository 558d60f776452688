"""Note [indices on a GPU]: on a GPU worker, index and probability values are checked
before the kernel, since a CUDA kernel's device-side assert loses the worker's context.
Each guard must refuse exactly what the CPU kernel refuses: checked here against CPU eager
on random values, in and out of range, negative and positive."""

from __future__ import annotations

import pytest
import torch

from djinn.appliance.executor import index_bounds, opargs
from djinn.errors import ExecutionError

CPU = torch.device("cpu")
aten = torch.ops.aten


def _guarded(op, *args, **kwargs) -> bool:
    """True when the guard refuses ``op(*args, **kwargs)``."""
    try:
        index_bounds.check(op, opargs.bind(op, list(args), kwargs, CPU))
    except ExecutionError as exc:
        assert "out of bounds" in str(exc) or "probab" in str(exc) or "p must" in str(exc)
        return True
    return False


def _eager_refuses(op, *args, **kwargs) -> bool:
    try:
        op(*args, **kwargs)
    except (IndexError, RuntimeError):
        return True
    return False


def _cases(idx, flat):
    """(op, args) pairs whose index tensors come from ``idx(*shape)`` (per dim) and
    ``flat(n)`` (over all 12 elements)."""
    x = torch.arange(12.0).reshape(3, 4)
    src = torch.ones(3, 4)
    return [
        (aten.index.Tensor, (x, [idx(2)])),
        (aten.index.Tensor, (x, [None, idx(2)])),
        (aten.index.Tensor, (x, [idx(2), idx(2)])),
        (aten.index_put.default, (x, [idx(2)], torch.ones(2, 4))),
        (aten.index_select.default, (x, 1, idx(3))),
        (aten.gather.default, (x, 0, idx(1, 4))),
        (aten.scatter.value, (x, 1, idx(3, 1), 1.0)),
        (aten.scatter_add.default, (x, 0, idx(1, 2), src)),
        (aten.index_add.default, (x, 0, idx(1), torch.ones(1, 4))),
        (aten.index_copy.default, (x, 0, idx(1), torch.ones(1, 4))),
        (aten.index_fill.int_Scalar, (x, 1, idx(1), 2.0)),
        (aten.take.default, (x, flat(3))),
        (aten.put.default, (x, flat(2), torch.ones(2))),
        (aten.embedding.default, (x, idx(3))),
    ]


def _agree(cases) -> None:
    for op, args in cases:
        assert _guarded(op, *args) == _eager_refuses(op, *args), (op, args)


@pytest.mark.parametrize("value", range(-14, 15))
def test_each_guard_refuses_exactly_the_values_the_cpu_kernel_refuses(value):
    """Every index one value, around each dimension's bounds: -13..-1 wrap or not."""
    full = lambda *shape: torch.full(shape, value)  # noqa: E731
    _agree(_cases(full, full))


@pytest.mark.parametrize("seed", range(20))
def test_each_guard_agrees_with_the_cpu_kernel_on_mixed_values(seed):
    gen = torch.Generator().manual_seed(seed)
    idx = lambda *shape: torch.randint(-6, 7, shape, generator=gen)  # noqa: E731
    flat = lambda n: torch.randint(-14, 14, (n,), generator=gen)  # noqa: E731
    _agree(_cases(idx, flat))


def test_probabilities_the_cpu_refuses_are_refused():
    good = torch.tensor([[0.2, 0.8], [1.0, 0.0]])
    assert not _guarded(aten.multinomial.default, good, 1)
    for bad in ([[-1.0, 2.0]], [[float("nan"), 1.0]], [[0.0, 0.0]], [[float("inf"), 1.0]]):
        p = torch.tensor(bad)
        assert _guarded(aten.multinomial.default, p, 1)
        assert _eager_refuses(aten.multinomial.default, p, 1)
    x = torch.zeros(3)
    assert not _guarded(aten.bernoulli_.Tensor, x, torch.tensor([0.0, 0.5, 1.0]))
    for bad in ([1.5, 0.0, 0.0], [-0.1, 0.0, 0.0]):
        assert _guarded(aten.bernoulli_.Tensor, x, torch.tensor(bad))
        assert _eager_refuses(aten.bernoulli_.Tensor, x.clone(), torch.tensor(bad))


def test_an_embedding_gradient_with_an_index_past_its_rows_is_refused_but_padding_is_not():
    grad = torch.ones(3, 2)
    ok = torch.tensor([0, 3, 1])
    assert not _guarded(aten.embedding_dense_backward.default, grad, ok, 4, -1, False)
    bad = torch.tensor([0, 9, 1])
    assert _guarded(aten.embedding_dense_backward.default, grad, bad, 4, -1, False)
    padded = torch.tensor([0, 9, 1])  # 9 is the padding index: never read
    assert not _guarded(aten.embedding_dense_backward.default, grad, padded, 10, 9, False)
