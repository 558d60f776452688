"""``TensorStore.recharge``: a storage an ``out=`` op grew is charged, and kept under its
new address (storages are keyed by address), from the handles the graph named."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from djinn.appliance.store import TensorStore
from djinn.appliance.vmu.device import DeviceVMU


def _store_and_session() -> tuple[TensorStore, SimpleNamespace]:
    store = TensorStore(SimpleNamespace(size=0), 0, 1 << 20, DeviceVMU(256 << 20))
    session = SimpleNamespace(id="s", handles={}, storages={}, data_bytes=0, staged_bytes=0)
    return store, session


def _grow(t: torch.Tensor, n: int) -> None:
    torch.add(torch.ones(n), 1, out=t)  # resizes ``t``'s storage: new bytes, new address


def test_a_moved_storage_is_charged_and_rekeyed_for_every_handle_of_it():
    store, s = _store_and_session()
    t = torch.zeros(4)
    named, view = store.keep(s, t), store.keep(s, t[1:])
    bystander = store.keep(s, torch.zeros(8))
    old = t.untyped_storage().data_ptr()
    _grow(t, 1 << 16)
    assert t.untyped_storage().data_ptr() != old
    store.recharge(s, [named])
    now = t.untyped_storage()
    assert s.data_bytes == now.nbytes() + 32 == store.vmu["data"].used
    assert s.handles[named][1] == s.handles[view][1] == now.data_ptr()  # the view too
    assert old not in s.storages  # a new tensor at the old address is a tensor of its own
    for h in (named, view, bystander):
        store.drop(s, h)
    assert s.data_bytes == 0 == store.vmu["data"].used and not s.storages


def test_a_zero_byte_handle_given_bytes_is_charged_whole():
    store, s = _store_and_session()
    t = torch.empty(0)
    handles = [store.keep(s, t), store.keep(s, t)]
    assert s.data_bytes == 0
    _grow(t, 1 << 16)
    store.recharge(s, handles)
    assert s.data_bytes == 1 << 18 == store.vmu["data"].used
    assert len(s.storages) == 1
    store.drop(s, handles[0])
    assert s.data_bytes == 1 << 18  # the other handle still holds it
    store.drop(s, handles[1])
    assert s.data_bytes == 0 == store.vmu["data"].used and not s.storages


def test_a_storage_that_did_not_grow_is_left_as_it_was():
    store, s = _store_and_session()
    t = torch.zeros(16)
    h = store.keep(s, t)
    before = dict(s.storages), dict(s.handles)
    t.add_(1)
    store.recharge(s, [h, "not-a-handle"])
    assert (dict(s.storages), dict(s.handles)) == before and s.data_bytes == 64


def _held(s: SimpleNamespace) -> int:
    """Bytes the session's handles hold, each storage once."""
    seen: dict[int, int] = {}
    for t, _key in s.handles.values():
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def test_a_storage_moved_onto_the_address_another_left_keeps_both_accounts():
    """One graph: X leaves its address and Y, named first, lands on it (found by review:
    re-keying Y overwrote X's account, and 4 KB stayed charged after both were dropped)."""
    store, s = _store_and_session()
    x, y = torch.zeros(64), torch.zeros(4)
    hy, hx = store.keep(s, y), store.keep(s, x)
    left = x.untyped_storage()
    x.set_(torch.zeros(1 << 12))  # as a resize moves it
    y.set_(left)  # Y's storage is now at X's old address
    del left
    store.recharge(s, [hy, hx])
    assert s.data_bytes == _held(s) == store.vmu["data"].used
    for h in (hx, hy):
        assert s.handles[h][1] == s.handles[h][0].untyped_storage().data_ptr()
    store.drop(s, hx), store.drop(s, hy)
    assert s.data_bytes == 0 == store.vmu["data"].used and not s.storages


def test_a_zero_byte_storage_grown_through_one_handle_then_another():
    """Two handles of one empty tensor; graph 1 grows it through one, graph 2 through the
    other; the one not named is charged with it and dropping both frees all."""
    store, s = _store_and_session()
    t = torch.empty(0)
    a, b = store.keep(s, t), store.keep(s, t)
    _grow(t, 1 << 8)
    store.recharge(s, [a])
    assert s.handles[a][1] == s.handles[b][1] and s.data_bytes == 1 << 10
    _grow(t, 1 << 16)
    store.recharge(s, [b])
    assert s.data_bytes == _held(s) == 1 << 18 == store.vmu["data"].used
    store.drop(s, a)
    assert s.data_bytes == 1 << 18  # b still holds it
    store.drop(s, b)
    assert s.data_bytes == 0 == store.vmu["data"].used and not s.storages
