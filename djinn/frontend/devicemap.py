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
# 0-d tensor" (a hunt). The remote elements of such data are read first, one request
# each, as eager reads each CUDA element.
_FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray, torch.Tensor.new_tensor}


def _elements_here(func: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    at = 1 if func is torch.Tensor.new_tensor else 0  # new_tensor(self, data)
    if len(args) > at:
        data = args[at]
        if isinstance(data, (list, tuple)) and _holds_remote(data):
            args = (*args[:at], _read(data), *args[at + 1 :])
        return args, kwargs
    for name in ("data", "obj"):
        data = kwargs.get(name)
        if isinstance(data, (list, tuple)) and _holds_remote(data):
            kwargs = {**kwargs, name: _read(data)}
    return args, kwargs


def _holds_remote(data: Any) -> bool:
    if isinstance(data, torch.Tensor):
        return data.device.type == DEVICE_TYPE
    return isinstance(data, (list, tuple)) and any(_holds_remote(x) for x in data)


def _read(data: Any) -> Any:
    if isinstance(data, torch.Tensor):
        return data.cpu() if data.device.type == DEVICE_TYPE else data
    if isinstance(data, list):
        return [_read(x) for x in data]
    if isinstance(data, tuple):
        return tuple(_read(x) for x in data)
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
        if func in _FROM_DATA:
            args, kwargs = _elements_here(func, args, kwargs)
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
