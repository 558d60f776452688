"""Device mapping for unmodified scripts (`djinn run --device-map cuda=remote_accelerator`).

A TorchFunctionMode rewrites device arguments on their way into any torch function or
tensor method (``.cuda()``, ``.to("cuda")``, ``device=torch.device("cuda", 0)``), and the
few ``torch.cuda`` queries scripts branch on (``is_available``, ``device_count``...)
answer for the appliance; ``torch.device("cuda", i)`` itself evaluates to
``remote_accelerator:i``.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from . import legacy_types, pinned
from .device import DEVICE_TYPE, pop_mapped, push_mapped
from .extension_points import (
    ACCELERATE_FP16,
    CUDA_QUERIES,
    LEGACY_TYPES,
    MAPPED_GENERATOR,
    register,
)


def _target(dev: Any, source: str, index_base: int) -> Any:
    if isinstance(dev, torch.device):
        if dev.type == source:
            return torch.device(DEVICE_TYPE, index_base if dev.index is None else dev.index)
        return dev
    if isinstance(dev, str):
        kind, _, index = dev.partition(":")
        if kind == source:
            return torch.device(DEVICE_TYPE, int(index) if index else index_base)
    if isinstance(dev, int) and not isinstance(dev, bool):
        return dev
    return dev


_IS_CUDA = torch._C.TensorBase.__dict__["is_cuda"]  # the getter arrives as its bound __get__


# Note [tensors in a list of data]: ``torch.tensor(losses)`` of a list of CUDA 0-d tensors
# (per-step losses, ``[a.argmax(), a.argmin()]``) reads each element's value, and makes
# the new tensor where its own ``device`` says. PyTorch reads a tensor element's memory
# directly, and a remote tensor has none on the client: it met an untyped "len() of a
# 0-d tensor" (a hunt). So where such a call fails and its data holds remote tensors,
# they are read (a list of one dtype and shape in one request: stacked, then fetched)
# and the call made again. Data without them, the common case, costs nothing more: it is
# not walked (a review: a check before every call made ``torch.tensor`` of a million
# floats 2.8x slower).
_FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray, torch.Tensor.new_tensor}


def _from_data(func: Any, args: tuple, kwargs: dict) -> Any:
    try:
        return func(*args, **kwargs)
    except (TypeError, RuntimeError, ValueError):
        at = 1 if func is torch.Tensor.new_tensor else 0  # new_tensor(self, data)
        name = next((n for n in ("data", "obj") if n in kwargs), None)
        data = args[at] if len(args) > at else kwargs.get(name) if name else None
        leaves: list[torch.Tensor] = []
        if not isinstance(data, (list, tuple)) or not _remote_leaves(data, leaves):
            raise
    read = _read_all(leaves)
    data = _replaced(data, read)
    if len(args) > at:
        return func(*args[:at], data, *args[at + 1 :], **kwargs)
    return func(*args, **{**kwargs, name: data})


def _remote_leaves(data: Any, out: list[torch.Tensor]) -> bool:
    for x in data:
        if isinstance(x, torch.Tensor):
            if x.device.type == DEVICE_TYPE:
                out.append(x)
        elif isinstance(x, (list, tuple)):
            _remote_leaves(x, out)
    return bool(out)


def _read_all(leaves: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """Each remote leaf's value on the CPU, by ``id``: one request where they stack."""
    first = leaves[0]
    if len(leaves) > 1 and all(x.dtype == first.dtype and x.shape == first.shape for x in leaves):
        with torch.no_grad():
            values = torch.stack([x.detach() for x in leaves]).cpu().unbind(0)
    else:
        values = [x.detach().cpu() for x in leaves]
    return {id(x): v for x, v in zip(leaves, values, strict=True)}


def _replaced(data: Any, read: dict[int, torch.Tensor]) -> Any:
    if isinstance(data, torch.Tensor):
        return read.get(id(data), data)
    if isinstance(data, list):
        return [_replaced(x, read) for x in data]
    if isinstance(data, tuple):
        return tuple(_replaced(x, read) for x in data)
    return data


class DeviceMap(TorchFunctionMode):
    def __init__(self, source: str = "cuda") -> None:
        super().__init__()
        self.source = source

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__self__", None) is _IS_CUDA and self.source == "cuda":
            return args[0].device.type in (DEVICE_TYPE, "cuda")
        if torch.is_autocast_enabled(self.source) and not torch.is_autocast_enabled(DEVICE_TYPE):
            # Note [mapped autocast]: `torch.autocast("cuda")` only turns on CUDA's autocast
            # key; the script's tensors live on the remote device, so the same autocast is
            # applied there, call by call, with the script's dtype.
            with torch.autocast(DEVICE_TYPE, dtype=torch.get_autocast_dtype(self.source)):
                return self.__torch_function__(func, types, args, kwargs)
        if func is torch.device:  # torch.device("cuda", 0) *is* the appliance's device
            return _target(func(*args, **kwargs), self.source, 0)
        if func is torch.Tensor.type and self.source == "cuda":  # Note [legacy CUDA tensor types]
            answer = legacy_types.retyped(args, kwargs)
            if answer is not None:
                return answer
        if func is torch.Tensor.cuda:
            device = args[1] if len(args) > 1 else kwargs.get("device")
            target = torch.device(DEVICE_TYPE, device if isinstance(device, int) else 0)
            if isinstance(device, (str, torch.device)):
                target = _target(device, self.source, 0)
            return args[0].to(target, non_blocking=kwargs.get("non_blocking", False))
        if "device" in kwargs:
            kwargs = {**kwargs, "device": _target(kwargs["device"], self.source, 0)}
        if kwargs.get("pin_memory") and pinned.OURS[0]:  # a factory's pinned CPU tensor
            device = kwargs.get("device")
            if device is None or torch.device(device).type == "cpu":
                return pinned.remember(func(*args, **{**kwargs, "pin_memory": False}))
        if args and any(isinstance(a, (str, torch.device)) for a in args):
            args = tuple(
                _target(a, self.source, 0) if isinstance(a, (str, torch.device)) else a
                for a in args
            )
        if func in _FROM_DATA:  # Note [tensors in a list of data]
            return _from_data(func, args, kwargs)
        return func(*args, **kwargs)


# Note [mapped threads]: a TorchFunctionMode is entered per thread, so ``djinn run``'s map
# held for the script's main thread alone: ``torch.zeros(3, device="cuda")`` in a thread
# the script started (a server's handler, a producer thread, a thread pool) failed with
# "Torch not compiled with CUDA enabled" (a review). While it is installed, every thread
# started from then on enters the same map first, through ``Thread._bootstrap_inner``
# (which every ``Thread`` runs, whatever its ``run``); Djinn's own threads ("djinn-...")
# do not need it.
_threads: list[Any] = []  # the Thread._bootstrap_inner to put back, per install


def _map_new_threads(source: str) -> None:
    original = threading.Thread._bootstrap_inner  # type: ignore[attr-defined]

    def bootstrap_inner(self: threading.Thread) -> None:
        if self.name.startswith("djinn-"):
            return original(self)
        mode = DeviceMap(source)
        mode.__enter__()
        try:
            return original(self)
        finally:
            mode.__exit__(None, None, None)

    _threads.append(original)
    threading.Thread._bootstrap_inner = bootstrap_inner  # type: ignore[attr-defined]


def install(source: str = "cuda") -> DeviceMap:
    """Enter the mapping for the calling thread; for CUDA, answer torch.cuda's queries for
    the appliance (Note [cuda queries]) and admit the appliance to accelerate's fp16 (Note
    [accelerate's fp16]) until ``uninstall``."""
    register()
    if source == "cuda":
        CUDA_QUERIES.acquire()
        ACCELERATE_FP16.acquire()  # Note [accelerate's fp16]
        MAPPED_GENERATOR.acquire()  # torch.Generator("cuda")
        LEGACY_TYPES.acquire()  # torch.cuda.FloatTensor
    mode = DeviceMap(source)
    mode.__enter__()
    push_mapped(source)
    _map_new_threads(source)  # Note [mapped threads]
    return mode


def uninstall(mode: DeviceMap) -> None:
    if _threads:
        threading.Thread._bootstrap_inner = _threads.pop()  # type: ignore[attr-defined]
    mode.__exit__(None, None, None)
    pop_mapped()
    if mode.source == "cuda":
        LEGACY_TYPES.release()
        MAPPED_GENERATOR.release()
        ACCELERATE_FP16.release()
        CUDA_QUERIES.release()
