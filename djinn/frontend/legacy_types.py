"""torch.cuda's legacy tensor types under ``djinn run``.

Note [legacy CUDA tensor types]: older scripts, and many still copied from them (the
PyTorch-GAN family: ``Tensor = torch.cuda.FloatTensor if cuda else torch.FloatTensor``,
then ``Tensor(n, 1).fill_(1.0)``, ``Tensor(np_array)``, ``imgs.type(Tensor)``), name a
dtype and the GPU by a type. Under ``djinn run`` the script is told it has CUDA, and
those types failed untyped as they do on a CPU-only PyTorch ("type torch.cuda.FloatTensor
not available", "Cannot initialize CUDA without ATen_cuda library"; a hunt). While ``djinn
run`` holds the ``LEGACY_TYPES`` attachment (extension_points.py),
``torch.cuda.FloatTensor`` and its siblings are stand-ins of the remote device:

- called, they make what the legacy constructor makes: ``T(*sizes)`` or ``T(torch.Size)``
  an uninitialised tensor, ``T(data)`` (a sequence, a NumPy array) the data in the type's
  dtype, ``T()`` an empty one;
- ``isinstance(x, T)`` holds for a remote tensor of the type's dtype;
- ``x.type(T)``, and ``x.type("torch.cuda.FloatTensor")``, move and cast ``x`` there, and
  ``x.type()`` names a remote tensor's type as CUDA's (``torch.cuda.FloatTensor``);
- ``torch.set_default_tensor_type(T)`` sets the type's dtype and the remote device as
  the defaults.
"""

from __future__ import annotations

import operator
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

    def __call__(cls, *args: Any, size: Any = None, device: Any = None) -> torch.Tensor:
        # ``device=`` is the GPU's: the remote device, whatever index it names
        where = torch.device(DEVICE_TYPE, 0)
        if size is not None:
            args = (*args, *size)
        if not args:
            return torch.empty(0, dtype=cls.dtype, device=where)
        if len(args) == 1 and isinstance(args[0], torch.Size):
            args = tuple(args[0])
        sizes = _sizes(args)
        if sizes is not None:
            return torch.empty(sizes, dtype=cls.dtype, device=where)
        if len(args) == 1:
            data = args[0]
            if isinstance(data, torch.Tensor):
                return data.to(device=where, dtype=cls.dtype)
            if isinstance(data, (bool, float, complex)):  # as PyTorch's own constructor
                raise TypeError(f"new(): data must be a sequence (got {type(data).__name__})")
            return torch.tensor(data, dtype=cls.dtype, device=where)
        raise TypeError(f"torch.cuda.{cls.__name__}(): sizes or one sequence of data")


def _sizes(args: tuple) -> tuple[int, ...] | None:
    """The sizes ``args`` are (ints, NumPy's included: ``operator.index``), or None."""
    sizes = []
    for a in args:
        if isinstance(a, (bool, torch.Tensor)):
            return None
        try:
            sizes.append(operator.index(a))
        except TypeError:  # data (a NumPy array has __index__, and refuses it)
            return None
    return tuple(sizes)


STAND_INS = {
    name: _LegacyType(name, (), {"dtype": dtype, "__module__": "torch.cuda", "is_cuda": True})
    for name, dtype in TYPES.items()
}


def default_tensor_type(original: Any) -> Any:
    """``torch.set_default_tensor_type(torch.cuda.FloatTensor)`` (or its name): the
    type's dtype and the remote device as the defaults, what it does on a GPU (a review:
    PyTorch refused the stand-in, "only floating-point types")."""

    def set_default_tensor_type(t: Any) -> None:
        if isinstance(t, str) and t.startswith("torch.cuda."):
            t = STAND_INS.get(t.removeprefix("torch.cuda."), t)
        if not isinstance(t, _LegacyType):
            return original(t)
        if not t.dtype.is_floating_point:
            raise TypeError("only floating-point types are supported as the default type")
        torch.set_default_dtype(t.dtype)
        torch.set_default_device(torch.device(DEVICE_TYPE, 0))

    return set_default_tensor_type


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
