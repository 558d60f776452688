"""``torch.Generator("cuda")`` under ``djinn run`` (Note [explicit generators] in seeded.py).

PyTorch makes a CUDA generator only with its CUDA library, and a generator of the remote
device not at all (a Python backend cannot register one), so a script's
``torch.Generator("cuda")`` failed under ``djinn run`` before its first op. The class is a
constructor, not a torch function, so the device map's mode never sees it: while ``djinn
run`` holds the ``MAPPED_GENERATOR`` attachment, ``torch.Generator`` is a stand-in whose
call makes a CPU generator for the mapped device or the remote one, and PyTorch's own
generator for any other. It is PyTorch's class for ``isinstance``, ``issubclass`` and its
attributes, and every generator it makes is PyTorch's own. A random op on the remote
device draws from such a generator as it would on the CPU.
"""

from __future__ import annotations

from typing import Any

import torch

from .device import DEVICE_TYPE

_TORCH_GENERATOR = torch._C.Generator


class _GeneratorType(type):
    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, _TORCH_GENERATOR)

    def __subclasscheck__(cls, sub: Any) -> bool:
        return issubclass(sub, _TORCH_GENERATOR)

    def __getattr__(cls, name: str) -> Any:  # Generator.manual_seed, __doc__...
        return getattr(_TORCH_GENERATOR, name)

    def __call__(cls, device: Any = "cpu") -> torch.Generator:
        try:
            kind = torch.device(device).type  # "cuda" is the remote device in the mode
        except (RuntimeError, TypeError):
            kind = None  # PyTorch says what is wrong with it
        if kind in ("cuda", DEVICE_TYPE):
            return _TORCH_GENERATOR("cpu")
        return _TORCH_GENERATOR(device)


class Generator(metaclass=_GeneratorType):
    """``torch.Generator`` under ``djinn run``: a CPU generator for a mapped device."""


def attach() -> Any:
    saved = torch.Generator
    torch.Generator = Generator
    return saved


def detach(saved: Any) -> None:
    torch.Generator = saved
