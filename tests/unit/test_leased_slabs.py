"""Note [lease ahead], the client's side: which slabs a PUT leases ahead, which it takes,
and which it gives back."""

from __future__ import annotations

import pytest
import torch

from djinn.runtime.slabs import ALIGN, BUDGET_MAX, IDLE_PUTS, LeasedSlabs, copy_bytes, size_class

MIB = 1 << 20


def test_a_size_is_leased_ahead_once_it_repeats():
    s = LeasedSlabs(1 << 30)
    assert s.plan([MIB]) == ([], [])  # first seen: nothing ahead
    assert s.plan([MIB]) == ([MIB], [])  # seen again: one slab for the next put
    s.add([4096 * 7], [MIB])
    assert s.take([MIB, MIB]) == [4096 * 7, None]  # one spare, the other ALLOCated
    assert s.held == 0


def test_sizes_share_a_class_by_page():
    s = LeasedSlabs(1 << 30)
    s.plan([MIB - 5])
    (lease,), _ = s.plan([MIB - 1])
    assert lease == size_class(MIB) == MIB
    s.add([ALIGN], [lease])
    assert s.take([MIB - 100]) == [ALIGN]  # any size of the class fits the slab


def test_no_more_than_the_previous_put_had_and_no_double_spares():
    s = LeasedSlabs(1 << 30)
    s.plan([MIB] * 3)
    lease, _ = s.plan([MIB] * 5)
    assert lease == [MIB] * 3
    s.add([1, 2, 3], lease)
    lease, _ = s.plan([MIB] * 5)  # three spares already wait: two more
    assert lease == [MIB] * 2
    s.add([4, 5], lease)
    assert s.plan([MIB] * 5)[0] == []  # five wait: enough for a put of five


def test_the_budget_bounds_the_spares():
    s = LeasedSlabs(1 << 40)
    assert s.budget == BUDGET_MAX
    big = 40 * MIB
    s.plan([big, big])
    lease, _ = s.plan([big, big])
    assert lease == [big]  # two would be 80 MiB
    assert LeasedSlabs(64 * MIB).budget == MIB  # a 64th of a small arena
    assert LeasedSlabs(0).plan([4096])[0] == [] and LeasedSlabs(0).budget == 0


def test_a_size_not_put_again_gives_its_spares_back():
    s = LeasedSlabs(1 << 30)
    s.plan([MIB])
    lease, _ = s.plan([MIB])
    s.add([ALIGN * 3], lease)
    for i in range(IDLE_PUTS):
        assert s.plan([2 * MIB])[1] == [], i
    assert s.plan([2 * MIB])[1] == [ALIGN * 3]
    assert s.held == 0 and s.take([MIB]) == [None]


def test_drain_gives_every_spare_back():
    s = LeasedSlabs(1 << 30)
    s.add([1, 2], [MIB, 2 * MIB])
    assert sorted(s.drain()) == [1, 2] and s.held == 0 and s.take([MIB]) == [None]


def test_copy_bytes_copies_small_and_large(monkeypatch):
    from djinn.runtime import slabs

    monkeypatch.setattr(slabs, "MEMMOVE_MAX", 1 << 20)  # past it: torch's copy_
    for n in (0, 1, 5000, 1 << 20, (1 << 20) + 1, 9 << 20):
        src = torch.randint(0, 255, (n,), dtype=torch.uint8)
        dst = torch.zeros(n, dtype=torch.uint8)
        copy_bytes(dst, src)
        assert torch.equal(dst, src)


def test_copy_bytes_refuses_a_destination_of_another_length():
    dst = torch.zeros(4, dtype=torch.uint8)
    with pytest.raises(ValueError, match="copy of 5 bytes into 4"):
        copy_bytes(dst, torch.ones(5, dtype=torch.uint8))
    assert not dst.any()
