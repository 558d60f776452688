"""``torch.save`` / ``torch.load`` of remote tensors, as for CUDA tensors.

Saving: a remote tensor pickles as its bytes, fetched to the client, with its device
recorded (``torch._utils._rebuild_device_tensor_from_cpu_tensor``, which ``torch.load``'s
weights-only unpickler allows; ``LazyTensor.__reduce_ex__``). Loading without
``map_location`` puts it back on the remote device; ``map_location="cpu"`` keeps it
local, as PyTorch does for CUDA tensors.

Note [load to the remote device]: ``map_location`` acts on storages, and a remote
tensor has none on the client. A location naming the remote device (or ``cuda`` under
``djinn run`` on a client without CUDA) therefore restores storages to host memory;
tensors saved from the remote device move back to it as they are rebuilt, and plain CPU
tensors stay on the host until first used with remote tensors (which uploads them).

Note [checkpoints name the mapped device]: under ``djinn run`` the program's tensors are
CUDA tensors as far as it knows, and the checkpoints it writes are read later by plain
PyTorch, on a GPU or with ``map_location``. A remote tensor saved there records the
device the program named (``cuda:0``), not ``remote_accelerator:0``, which plain PyTorch
cannot even parse ("Expected one of cpu, cuda, ... device type"): such a checkpoint
loads as a CUDA checkpoint does with no ``map_location`` (on a GPU), a device
(``map_location="cpu"``) or a dict (``{"cuda:0": "cpu"}``, which matched nothing before),
and under ``djinn run`` again onto the appliance (the device map moves "cuda" there).
Saved outside ``djinn run`` it records the remote device, as the program named that.
Not as a CUDA checkpoint (a review): a *callable* ``map_location`` (``lambda s, loc:
s``) is refused by PyTorch for a tensor rebuilt from its bytes and device, and a
checkpoint in the legacy format (``_use_new_zipfile_serialization=False``) does not
load with ``map_location="cpu"`` on a host without CUDA. Saving a CPU storage tagged
``cuda:0`` instead would bring both, but under ``djinn run`` it would load onto the host,
not the appliance.
"""

from __future__ import annotations

from typing import Any

import torch

from .device import DEVICE_TYPE, mapped_source

PRIORITY = 15  # before CUDA's deserializer (20): it would refuse "cuda" without a GPU


def saved_device(t: torch.Tensor) -> str:
    """The device a saved remote tensor records (Note [checkpoints name the mapped
    device])."""
    source = mapped_source()
    if source is None:
        return str(t.device)
    return f"{source}:{t.device.index or 0}"


def tag(obj: Any) -> None:
    return None  # remote tensors are saved as CPU bytes: no storage carries our tag


def deserialize(obj: Any, location: str) -> Any:
    if location.startswith(DEVICE_TYPE):
        return obj
    if location.startswith("cuda") and not torch.cuda._is_compiled() and mapped_source() == "cuda":
        return obj
    return None  # not ours: the next package (CPU, CUDA...) decides
