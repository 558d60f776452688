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
"""

from __future__ import annotations

from typing import Any

import torch

from .device import DEVICE_TYPE, mapped_source

PRIORITY = 15  # before CUDA's deserializer (20): it would refuse "cuda" without a GPU


def tag(obj: Any) -> None:
    return None  # remote tensors are saved as CPU bytes: no storage carries our tag


def deserialize(obj: Any, location: str) -> Any:
    if location.startswith(DEVICE_TYPE):
        return obj
    if location.startswith("cuda") and not torch.cuda._is_compiled() and mapped_source() == "cuda":
        return obj
    return None  # not ours: the next package (CPU, CUDA...) decides
