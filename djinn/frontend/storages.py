"""A storage made on the remote device is refused, typed (Note [no storages on the remote
device] in device_module.py).

``torch.UntypedStorage(n, device="remote_accelerator:0")``, and ``torch.TypedStorage``,
which makes one the same way, asked the PrivateUse1 backend's allocator for the bytes.
A Python backend has none, and the process died (SIGSEGV, no traceback). While ``import
djinn`` holds the ``STORAGES`` attachment, the class's constructor refuses that device
first; every other device is PyTorch's own constructor, called as it was.
"""

from __future__ import annotations

from typing import Any

import torch

from djinn.errors import UnsupportedOp

from .device import is_remote, mapped_source

_NOT_HERE = (
    "a storage cannot be made on the remote device: the appliance holds tensors, not "
    "storages, and the client has no memory of the device's to give one. Make a tensor "
    "instead (torch.empty(n, dtype=torch.uint8, device=...))"
)


def attach() -> Any:
    cls = torch.UntypedStorage
    saved = cls.__dict__.get("__new__")  # None: the C base's, inherited
    made = saved.__func__ if isinstance(saved, staticmethod) else saved
    base_new = made or torch._C.StorageBase.__new__

    def __new__(klass: type, *args: Any, **kwargs: Any) -> Any:
        device = kwargs.get("device")
        if is_remote(device) or _mapped(device):
            raise UnsupportedOp(_NOT_HERE)
        return base_new(klass, *args, **kwargs)

    cls.__new__ = staticmethod(__new__)
    return saved


def _mapped(device: Any) -> bool:
    """A device ``djinn run`` maps to the appliance ("cuda" on a client without CUDA: the
    program is told it has CUDA, and PyTorch's own refusal was an untyped assertion)."""
    source = mapped_source()
    if source is None or not isinstance(device, str) or torch.cuda._is_compiled():
        return False  # a torch.device made under the map names the remote device already
    return device.split(":", 1)[0] == source


def detach(saved: Any) -> None:
    cls = torch.UntypedStorage
    if saved is None:
        del cls.__new__
    else:
        cls.__new__ = saved
