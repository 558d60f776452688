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
        words = ("out of bounds", "probab", "p must", "between 0 and 1", "rate", "offsets")
        assert any(w in str(exc) for w in words), str(exc)
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


def _labels_and_values():
    """(op, args) of the losses, samplers, unpooling and embedding bags whose CUDA kernels
    assert on a label or value the CPU kernel refuses: good and bad values alike."""
    x, w = torch.randn(2, 3), torch.randn(4, 3)
    u = torch.rand(2, 3)
    one = torch.tensor(1.0)
    cases = []
    for t in ([0, 2], [-1, 0], [3, 0], [1, 1]):
        cases.append((aten.multi_margin_loss.default, (x, torch.tensor(t))))
        cases.append((aten.multi_margin_loss_backward.default,
                      (one, x, torch.tensor(t), 1, 1, None, 1)))  # fmt: skip
    for row in ([0, 1, -1], [-1, 5, 7], [3, 0, -1], [-2, 0, 1], [2, 1, 0]):
        target = torch.tensor([row, [0, 1, 2]])
        cases.append((aten.multilabel_margin_loss_forward.default, (x, target, 1)))
    for value in (0.0, 1.0, 1.5, -0.5, float("nan")):
        full = torch.full((2, 3), value)
        cases.append((aten.binary_cross_entropy.default, (u, full)))
        cases.append((aten.binary_cross_entropy.default, (full, u)))
        cases.append((aten.poisson.default, (torch.tensor([value, 1.0]),)))
        cases.append((aten.bernoulli.default, (torch.tensor([value, 0.5]),)))
    for last in (3, 15, 16, 99, -1):
        idx = torch.tensor([[[[0, 1], [2, last]]]])
        cases.append((aten.max_unpool2d.default, (torch.randn(1, 1, 2, 2), idx, [4, 4])))
    bags = [([0, 3], [0]), ([0, 9], [0]), ([0, -1], [0]), ([0, 1], [0, 5])]
    bags += [([0, 1], [1]), ([0, 1, 2], [0, 2, 1]), ([0, 1, 2], [0, 1, 3])]
    for indices, offsets in bags:
        args = (w, torch.tensor(indices), torch.tensor(offsets))
        cases.append((aten._embedding_bag_forward_only.default, args))
    return cases


def test_label_and_value_guards_refuse_exactly_what_the_cpu_kernel_refuses():
    _agree(_labels_and_values())


def test_a_zero_dim_mask_covers_no_dimension_as_aten_counts_it():
    x = torch.arange(30.0).reshape(3, 10)
    for index in ([torch.tensor(True), torch.tensor([5])], [torch.tensor(True), torch.tensor([2])]):
        assert _guarded(aten.index.Tensor, x, index) == _eager_refuses(aten.index.Tensor, x, index)
    assert _guarded(aten.index.Tensor, x, [torch.tensor(True), torch.tensor([5])])


def test_probabilities_are_checked_in_their_own_dtype():
    x = torch.zeros(1, dtype=torch.float64)
    p = torch.tensor([1 + 1e-12], dtype=torch.float64)
    assert _guarded(aten.bernoulli_.Tensor, x, p) and _eager_refuses(aten.bernoulli_.Tensor, x, p)
    for weights in ([[1e300, 1.0]], [[1e-50, 1e-50]]):
        p = torch.tensor(weights, dtype=torch.float64)
        assert not _guarded(aten.multinomial.default, p, 1)
        assert not _eager_refuses(aten.multinomial.default, p, 1)


def test_embedding_renorm_refuses_past_the_rows_and_negative_rows_unlike_the_cpu():
    """The CPU wraps a negative row through ``select``; CUDA's kernel would address before
    the weight, so a GPU worker refuses it (F.embedding, which follows, refuses it too)."""
    w = torch.randn(4, 3)
    ok, past, negative = torch.tensor([0, 3]), torch.tensor([4]), torch.tensor([-1])
    assert not _guarded(aten.embedding_renorm_.default, w, ok, 1.0, 2.0)
    assert _guarded(aten.embedding_renorm_.default, w, past, 1.0, 2.0)
    assert _eager_refuses(aten.embedding_renorm_.default, w.clone(), past, 1.0, 2.0)
    assert _guarded(aten.embedding_renorm_.default, w, negative, 1.0, 2.0)
    assert not _eager_refuses(aten.embedding_renorm_.default, w.clone(), negative, 1.0, 2.0)
