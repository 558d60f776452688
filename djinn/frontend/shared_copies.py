"""Copies of remote tensors that share storage, as their originals did.

Note [copies keep shared storage]: ``copy.deepcopy`` and ``torch.save`` copy a storage
once, and every tensor on it (a view, a ``detach()``ed alias: a tied weight's two
``state_dict`` keys) is rebuilt on the one copy: writing into the copied view changes the
copied base, and a loaded checkpoint's tied keys are one tensor's bytes. A remote tensor
has no storage on the client, and each was copied alone: the copied view's writes went
nowhere, and ``sd[k].mul_(0.5)`` for every key of a tied checkpoint scaled its weight once
where eager scales it twice (a review). So each copy is made per storage (the ``Storage``
its views and aliases share, writes.py), from the tensor that spans it (``_base``, or the
tensor itself), and each tensor is that copy seen through its own sizes, strides and
offset (``as_strided``):

- ``copy.deepcopy``: the storage's copy is made on the appliance, once per deepcopy (its
  memo); a ``Parameter`` copies its value alone, as eager's ``Parameter.__deepcopy__``.
- ``torch.save``: the storage's bytes are fetched once per save (a memo per pickler), and
  each tensor is a CPU view of them, so the file holds them once, as eager's; loaded
  without Djinn (``map_location="cpu"``) the views share, as eager's.
- ``torch.load`` onto the remote device: each rebuilt tensor is a CPU view of a loaded
  storage, moved by ``_rebuild_device_tensor_from_cpu_tensor``; the storage is uploaded
  once per load (a memo per unpickler), and each tensor is a view of the upload.

A tensor that does not lie inside the copy made first (an alias of part of a storage met
before its base, another dtype on the same bytes) is copied alone, as before.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .writes import shared_storage

_SAVE = torch.serialization._save.__code__
_LOAD = torch.serialization._load.__code__
_REBUILD_MOVED = torch._utils._rebuild_device_tensor_from_cpu_tensor.__code__
_per_pickler: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _span(t: torch.Tensor) -> int:
    """Elements from ``t``'s first to its last, plus one (0 for an empty tensor)."""
    if t.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))


def _view(memo: dict, key: Any, t: torch.Tensor, root: torch.Tensor, make: Callable) -> Any:
    """``t`` seen through the copy of ``root``'s storage in ``memo[key]`` (made by
    ``make(root)`` the first time), or None where it does not lie inside that copy."""
    entry = memo.get(key)
    if entry is None:
        # only a root that fills every element of its span: a copy of a strided one
        # leaves the gaps between its elements unwritten, where another alias of the same
        # storage may lie (a review: a column's copy, then a deep-copied alias read
        # uninitialised memory)
        if _span(root) != root.numel() or (root.numel() and not _dense(root)):
            return None
        base = make(root)
        if base is None:
            return None
        entry = memo[key] = (base, root.storage_offset(), root.dtype, _span(root))
    base, origin, dtype, span = entry
    offset = t.storage_offset() - origin
    if t.dtype != dtype or offset < 0 or offset + _span(t) > span:
        return None
    return base.as_strided(t.shape, t.stride(), base.storage_offset() + offset)


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements, in some order, are its span's (no gap, no overlap)."""
    return bool(torch._prims_common.is_non_overlapping_and_dense_or_false(t))


def _root(t: torch.Tensor) -> torch.Tensor:
    return t._base if t._base is not None else t


def deep_copy_view(t: torch.Tensor, memo: dict) -> torch.Tensor | None:
    """``t``'s deep copy on the copy of its storage made in this deepcopy, or None."""
    storage = shared_storage(t)
    if storage is None:
        return None

    def make(root: torch.Tensor) -> torch.Tensor:
        base = torch.empty_strided(root.shape, root.stride(), dtype=root.dtype, device=root.device)
        base.copy_(root)
        memo.setdefault(id(memo), []).append(storage)  # copy's keep-alive: ids stay unique
        return base

    with torch.no_grad():
        view = _view(memo, ("djinn storage", id(storage)), t, _root(t), make)
    return None if view is None else view.detach()


def saved_bytes(t: torch.Tensor, fetch: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``t`` as a CPU view of its storage's bytes fetched once in this ``torch.save``, or
    None outside one (or where it cannot share)."""
    pickler = _caller_local(_SAVE, "pickler")
    storage = shared_storage(t)
    if pickler is None or storage is None:
        return None
    memo = _per_pickler.setdefault(pickler, {})
    memo.setdefault("keep", []).append(storage)

    def make(root: torch.Tensor) -> torch.Tensor | None:
        if not root.is_contiguous():  # fetched dense: its strides would not be root's
            return None
        return fetch(root).detach()

    return _view(memo, id(storage), t, _root(t), make)


def loaded_upload(x: torch.Tensor, upload: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Inside ``torch.load``'s rebuild of a tensor saved from the remote device: ``x`` (a
    CPU view of a loaded storage) as a view of that storage uploaded once in this load;
    None elsewhere."""
    if getattr(_uploading, "whole", False) or _caller_local(_REBUILD_MOVED, None, 6) is None:
        return None
    unpickler = _caller_local(_LOAD, "unpickler")
    if unpickler is None:
        return None
    memo = _per_pickler.setdefault(unpickler, {})
    storage = x.untyped_storage()
    flat = torch.empty(0, dtype=x.dtype, device="cpu").set_(
        storage, 0, (storage.nbytes() // x.element_size(),)
    )

    def make(root: torch.Tensor) -> torch.Tensor:
        memo.setdefault("keep", []).append(storage)  # its address stays its own
        _uploading.whole = True
        try:
            return upload(root)
        finally:
            _uploading.whole = False

    return _view(memo, (storage.data_ptr(), storage.nbytes(), x.dtype), x, flat, make)


_uploading = threading.local()


def _caller_local(code: Any, name: str | None, depth: int = 64) -> Any:
    """The local ``name`` of the nearest caller running ``code`` (its frame when ``name``
    is None), within ``depth`` frames; None if there is none."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code is not code and depth > 0:
        frame, depth = frame.f_back, depth - 1
    if frame is None or frame.f_code is not code:
        return None
    return frame if name is None else frame.f_locals.get(name)


class RemoteStorage:
    """What ``untyped_storage()`` answers for a remote tensor.

    Note [remote storages]: a remote tensor has no storage on the client, and its C++
    one raises at ``data_ptr()`` ("an invalid python storage"). Libraries ask it to tell
    tensors that share memory apart: safetensors' ``storage_ptr`` and transformers'
    ``id_tensor_storage``, so ``save_pretrained`` and Trainer checkpoints of a model
    trained on the remote device crashed (a review). ``data_ptr()`` here is the address
    of the ``Storage`` its views and aliases share (writes.py; a number of its own, 2**40
    apart from any other, never memory), and a remote tensor's own ``data_ptr()`` that
    address plus its offset in bytes, as a device tensor's is (it was 0): safetensors
    keeps a tensor that covers its whole storage by comparing the two. ``nbytes()`` is
    the bytes of the tensor spanning the storage; the rest is the C++ storage's.
    """

    __slots__ = ("_address", "_real", "_root")

    def __init__(self, t: torch.Tensor) -> None:
        self._root = _root(t)
        self._address = address_of(t)
        self._real = torch._C.TensorBase.untyped_storage(t)

    def data_ptr(self) -> int:
        return self._address

    def nbytes(self) -> int:
        return torch._C.TensorBase.untyped_storage(self._root).nbytes()

    def size(self) -> int:
        return self.nbytes()

    def __len__(self) -> int:
        return self.nbytes()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def __repr__(self) -> str:
        return f"RemoteStorage({self.nbytes()} bytes on {self._real.device})"


def address_of(t: torch.Tensor) -> int:
    """The address ``data_ptr()`` gives ``t``'s storage (Note [remote storages])."""
    storage = shared_storage(t)
    return storage.address if storage is not None else 0


def data_ptr(t: torch.Tensor) -> int:
    """A remote tensor's ``data_ptr()``: its storage's address plus its offset in bytes."""
    base = address_of(t)
    return base + t.storage_offset() * t.element_size() if base else 0
