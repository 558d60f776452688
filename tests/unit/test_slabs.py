"""The arena slab allocator: alignment, exhaustion, coalescing, accounting."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from djinn.appliance.vmu.slabs import ALIGN, SlabAllocator
from djinn.errors import ResourceExhausted


def test_slabs_are_page_aligned_and_accounted():
    a = SlabAllocator(base=8192, capacity=16 * ALIGN)
    off = a.alloc(10)
    assert off % ALIGN == 0 and off >= 8192
    assert a.used == ALIGN and a.peak == ALIGN
    a.free(off)
    assert a.used == 0 and a.peak == ALIGN


def test_exhaustion_is_a_typed_error_and_loses_nothing():
    a = SlabAllocator(0, 4 * ALIGN)
    keep = a.alloc(3 * ALIGN)
    with pytest.raises(ResourceExhausted):
        a.alloc(2 * ALIGN)
    assert a.used == 3 * ALIGN
    a.free(keep)
    assert a.alloc(4 * ALIGN) == 0


def test_freed_neighbours_coalesce_into_one_range():
    a = SlabAllocator(0, 3 * ALIGN)
    x, y, z = a.alloc(ALIGN), a.alloc(ALIGN), a.alloc(ALIGN)
    a.free(x)
    a.free(z)
    a.free(y)
    assert a.alloc(3 * ALIGN) == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5 * ALIGN)), max_size=60))
def test_random_alloc_free_never_overlaps_and_returns_to_empty(ops):
    a = SlabAllocator(0, 64 * ALIGN)
    live: dict[int, int] = {}
    for do_alloc, n in ops:
        if do_alloc or not live:
            try:
                off = a.alloc(n)
            except ResourceExhausted:
                continue
            size = a.size_of(off)
            for o, s in live.items():
                assert off + size <= o or o + s <= off
            assert off >= 0 and off + size <= 64 * ALIGN
            live[off] = size
        else:
            off = next(iter(live))
            a.free(off)
            del live[off]
        assert a.used == sum(live.values())
    for off in list(live):
        a.free(off)
    assert a.used == 0
    assert a.alloc(64 * ALIGN) == 0
