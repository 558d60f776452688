"""Tensor descriptors: every dtype and layout survives to_wire/from_wire; bad ones are refused."""

from __future__ import annotations

import pytest
import torch

from djinn.errors import InvalidArgument
from djinn.protocol.tensors import DTYPES, from_wire, to_wire, validate


def _sample(dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(5, 7) > 0.5
    if dtype.is_complex:
        return torch.randn(5, 7, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(5, 7).to(dtype)
    return torch.randint(0, 100, (5, 7)).to(dtype)


def _roundtrip(t: torch.Tensor) -> torch.Tensor:
    desc, raw = to_wire(t)
    assert raw.dtype == torch.uint8 and raw.dim() == 1
    return from_wire(desc, raw.clone())


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_every_dtype_round_trips_bit_exact(name):
    t = _sample(DTYPES[name])
    back = _roundtrip(t)
    assert back.dtype == t.dtype
    assert torch.equal(back.view(torch.uint8), t.view(torch.uint8))


LAYOUTS = {
    "contiguous": lambda: torch.randn(3, 4),
    "transposed": lambda: torch.randn(3, 4).t(),
    "channels_last": lambda: torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
    "strided_slice": lambda: torch.randn(4, 6)[:, ::2],
    "expanded": lambda: torch.randn(3).expand(4, 3),
    "scalar": lambda: torch.tensor(3.5),
    "zero_size": lambda: torch.zeros(0, 3),
    "zero_size_3d": lambda: torch.zeros(2, 0, 5),
    "conj_view": lambda: torch.randn(4, dtype=torch.complex64).conj(),
    "neg_view": lambda: torch.randn(4, dtype=torch.complex64).conj().imag,
    "size_one_dims": lambda: torch.randn(1, 4, 1),
    "offset_view": lambda: torch.randn(10)[3:7],
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_odd_layouts_round_trip_with_values_equal(name):
    t = LAYOUTS[name]()
    back = _roundtrip(t)
    assert back.shape == t.shape
    assert torch.equal(back, t.resolve_conj().resolve_neg())


def test_dense_permuted_layouts_keep_their_strides():
    for t in (LAYOUTS["transposed"](), LAYOUTS["channels_last"]()):
        assert _roundtrip(t).stride() == t.stride()


def test_to_wire_does_not_copy_dense_tensors():
    t = torch.randn(8, 8).t()
    _desc, raw = to_wire(t)
    assert raw.data_ptr() == t.data_ptr()


@pytest.mark.parametrize(
    "desc",
    [
        {"dtype": "float128", "shape": [2], "strides": [1]},
        {"dtype": "float32", "shape": [-1], "strides": [1]},
        {"dtype": "float32", "shape": [2, 2], "strides": [1, 1]},  # overlapping
        {"dtype": "float32", "shape": [2, 2], "strides": [4, 1]},  # gaps: reads past the end
        {"dtype": "float32", "shape": [2], "strides": [1, 1]},
        {"dtype": "float32", "shape": "2", "strides": [1]},
        {"dtype": "float32", "shape": [2.0], "strides": [1]},
        {"dtype": "float32", "shape": [1] * 65, "strides": [1] * 65},
        [1, 2],
    ],
)
def test_validate_refuses_descriptors_that_could_read_out_of_bounds(desc):
    with pytest.raises(InvalidArgument):
        validate(desc)


def test_from_wire_refuses_a_buffer_of_the_wrong_size():
    desc, raw = to_wire(torch.randn(4))
    with pytest.raises(InvalidArgument):
        from_wire(desc, raw[:8])
