"""The ``remote_accelerator`` device's name, and which local device type scripts mapped
onto it (``djinn run``). How it is registered with PyTorch: ``extension_points.py``."""

from __future__ import annotations

import torch

DEVICE_TYPE = "remote_accelerator"

_mapped: list[str] = []  # device types `djinn run` maps onto the appliance (a stack)


def is_remote(dev: object) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == DEVICE_TYPE
    if isinstance(dev, str):
        return dev.split(":", 1)[0] == DEVICE_TYPE
    return False


def mapped_source() -> str | None:
    """The device type being mapped to the appliance, if `djinn run` installed one."""
    return _mapped[-1] if _mapped else None


def push_mapped(source: str) -> None:
    _mapped.append(source)


def pop_mapped() -> None:
    if _mapped:
        _mapped.pop()
