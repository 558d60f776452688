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
