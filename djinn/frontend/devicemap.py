"""Device mapping for unmodified scripts (`djinn run --device-map cuda=remote_accelerator`).

A TorchFunctionMode rewrites device arguments on their way into any torch function or
tensor method (``.cuda()``, ``.to("cuda")``, ``device=torch.device("cuda", 0)``), and the
few ``torch.cuda`` queries scripts branch on (``is_available``, ``device_count``...)
answer for the appliance; ``torch.device("cuda", i)`` itself evaluates to
``remote_accelerator:i``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from .device import DEVICE_TYPE, register


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


class DeviceMap(TorchFunctionMode):
    def __init__(self, source: str = "cuda") -> None:
        super().__init__()
        self.source = source

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.device:  # torch.device("cuda", 0) *is* the appliance's device
            return _target(func(*args, **kwargs), self.source, 0)
        if func is torch.Tensor.cuda:
            device = args[1] if len(args) > 1 else kwargs.get("device")
            target = torch.device(DEVICE_TYPE, device if isinstance(device, int) else 0)
            if isinstance(device, (str, torch.device)):
                target = _target(device, self.source, 0)
            return args[0].to(target, non_blocking=kwargs.get("non_blocking", False))
        if "device" in kwargs:
            kwargs = {**kwargs, "device": _target(kwargs["device"], self.source, 0)}
        if args and any(isinstance(a, (str, torch.device)) for a in args):
            args = tuple(
                _target(a, self.source, 0) if isinstance(a, (str, torch.device)) else a
                for a in args
            )
        return func(*args, **kwargs)


_saved: dict[str, Any] = {}
_active: list[str] = []


def active_source() -> str | None:
    """The device type being mapped to the appliance, if `djinn run` installed one."""
    return _active[-1] if _active else None


def install(source: str = "cuda") -> DeviceMap:
    """Enter the mapping for the calling thread and patch torch.cuda's queries."""
    register()
    if source == "cuda" and not _saved:
        _saved.update(
            is_available=torch.cuda.is_available,
            device_count=torch.cuda.device_count,
            current_device=torch.cuda.current_device,
            synchronize=torch.cuda.synchronize,
            get_device_name=torch.cuda.get_device_name,
            module_cuda=torch.nn.Module.cuda,
        )
        torch.cuda.is_available = lambda: True
        torch.cuda.device_count = lambda: 1
        torch.cuda.current_device = lambda: 0
        torch.cuda.get_device_name = lambda device=None: "Djinn remote_accelerator"
        torch.cuda.synchronize = lambda device=None: None
        torch.nn.Module.cuda = lambda self, device=None: self.to(
            torch.device(DEVICE_TYPE, device if isinstance(device, int) else 0)
        )
    mode = DeviceMap(source)
    mode.__enter__()
    _active.append(source)
    return mode


def uninstall(mode: DeviceMap) -> None:
    mode.__exit__(None, None, None)
    if _active:
        _active.pop()
    if _saved:
        torch.nn.Module.cuda = _saved.pop("module_cuda")
        for name, fn in _saved.items():
            setattr(torch.cuda, name, fn)
        _saved.clear()
