"""torch.cuda's legacy tensor types under ``djinn run``.

Note [legacy CUDA tensor types]: older scripts, and many still copied from them (the
PyTorch-GAN family: ``Tensor = torch.cuda.FloatTensor if cuda else torch.FloatTensor``,
then ``Tensor(n, 1).fill_(1.0)``, ``Tensor(np_array)``, ``imgs.type(Tensor)``), name a
dtype and the GPU by a type. Under ``djinn run`` the script is told it has CUDA, and
those types failed untyped as they do on a CPU-only PyTorch ("type torch.cuda.FloatTensor
not available", "Cannot initialize CUDA without ATen_cuda library"; a hunt). While ``djinn
run`` holds the ``LEGACY_TYPES`` attachment, ``torch.cuda.FloatTensor`` and its siblings
are stand-ins of the remote device:

- called, they make what the legacy constructor makes: ``T(*sizes)`` or ``T(torch.Size)``
  an uninitialised tensor, ``T(data)`` (a sequence, a NumPy array) the data in the type's
  dtype, ``T()`` an empty one;
- ``isinstance(x, T)`` holds for a remote tensor of the type's dtype;
- ``x.type(T)``, and ``x.type("torch.cuda.FloatTensor")``, move and cast ``x`` there, and
  ``x.type()`` names a remote tensor's type as CUDA's (``torch.cuda.FloatTensor``).
"""

from __future__ import annotations

from typing import Any

import torch

from .device import DEVICE_TYPE

TYPES = {
    "FloatTensor": torch.float32,
    "DoubleTensor": torch.float64,
    "HalfTensor": torch.float16,
    "BFloat16Tensor": torch.bfloat16,
    "LongTensor": torch.int64,
    "IntTensor": torch.int32,
    "ShortTensor": torch.int16,
    "CharTensor": torch.int8,
    "ByteTensor": torch.uint8,
    "BoolTensor": torch.bool,
}
NAMES = {dtype: name for name, dtype in TYPES.items()}


class _LegacyType(type):
    dtype: torch.dtype

    def __instancecheck__(cls, x: Any) -> bool:
        return isinstance(x, torch.Tensor) and x.device.type == DEVICE_TYPE and x.dtype == cls.dtype

    def __call__(cls, *args: Any, **kwargs: Any) -> torch.Tensor:
        device = torch.device(DEVICE_TYPE, 0)
        if kwargs:
            raise TypeError(f"torch.cuda.{cls.__name__}() takes no keyword arguments here")
        if not args:
            return torch.empty(0, dtype=cls.dtype, device=device)
        if len(args) == 1 and isinstance(args[0], torch.Size):
            args = tuple(args[0])
        if all(type(a) is int for a in args):
            return torch.empty(args, dtype=cls.dtype, device=device)
        if len(args) == 1:
            data = args[0]
            if isinstance(data, torch.Tensor):
                return data.to(device=device, dtype=cls.dtype)
            return torch.tensor(data, dtype=cls.dtype, device=device)
        raise TypeError(f"torch.cuda.{cls.__name__}(): sizes or one sequence of data")


STAND_INS = {
    name: _LegacyType(name, (), {"dtype": dtype, "__module__": "torch.cuda", "is_cuda": True})
    for name, dtype in TYPES.items()
}


def attach() -> dict[str, Any]:
    saved = {name: getattr(torch.cuda, name, None) for name in TYPES}
    for name, cls in STAND_INS.items():
        setattr(torch.cuda, name, cls)
    return saved


def detach(saved: dict[str, Any]) -> None:
    for name, cls in saved.items():
        setattr(torch.cuda, name, cls)


def retyped(args: tuple, kwargs: dict) -> Any:
    """``Tensor.type`` of a legacy CUDA type or name (the Note): its answer, or None where
    PyTorch's own ``type`` answers."""
    x = args[0]
    to = args[1] if len(args) > 1 else kwargs.get("dtype")
    if to is None:
        if x.device.type == DEVICE_TYPE and x.dtype in NAMES:
            return f"torch.cuda.{NAMES[x.dtype]}"
        return None
    if isinstance(to, str) and to.startswith("torch.cuda."):
        to = STAND_INS.get(to.removeprefix("torch.cuda."))
    if isinstance(to, _LegacyType):
        blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
        return x.to(device=torch.device(DEVICE_TYPE, 0), dtype=to.dtype, non_blocking=blocking)
    return None
