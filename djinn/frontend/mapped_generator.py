"""``torch.Generator("cuda")`` under ``djinn run`` (Note [explicit generators] in
own_generators.py).

PyTorch makes a CUDA generator only with its CUDA library, and a generator of the remote
device not at all (a Python backend cannot register one), so a script's
``torch.Generator("cuda")`` failed under ``djinn run`` before its first op. The class is a
constructor, not a torch function, so the device map's mode never sees it: while ``djinn
run`` holds the ``MAPPED_GENERATOR`` attachment, ``torch.Generator`` is a stand-in whose
call makes a CPU generator for the mapped device or the remote one, and PyTorch's own
generator for any other. It is a subclass of PyTorch's class, which ``isinstance`` and
``issubclass`` take for PyTorch's own: a program's subclass of it is made as in eager.
What differs: ``type(torch.default_generator) is torch.Generator`` is False while it is
held. A random op on the remote device draws from such a generator as it would on the
CPU.
"""

from __future__ import annotations

from typing import Any

import torch

from .device import DEVICE_TYPE

_TORCH_GENERATOR = torch._C.Generator


def _mapped(device: Any) -> bool:
    try:
        return torch.device(device).type in ("cuda", DEVICE_TYPE)  # "cuda" is ours in the mode
    except (RuntimeError, TypeError):
        return False  # PyTorch says what is wrong with it


class _GeneratorType(type(_TORCH_GENERATOR)):  # PyTorch's metaclass (OpaqueBaseMeta)
    """The stand-in answers ``isinstance`` and ``issubclass`` as PyTorch's class does (a
    generator PyTorch made, ``torch.default_generator``, is one); a class derived from it
    answers as any class."""

    def __instancecheck__(cls, obj: Any) -> bool:
        if cls is Generator:
            return isinstance(obj, _TORCH_GENERATOR)
        return super().__instancecheck__(obj)

    def __subclasscheck__(cls, sub: Any) -> bool:
        if cls is Generator:
            return issubclass(sub, _TORCH_GENERATOR)
        return super().__subclasscheck__(sub)


class Generator(_TORCH_GENERATOR, metaclass=_GeneratorType):
    """``torch.Generator`` under ``djinn run``: a CPU generator for a mapped device. A
    subclass of PyTorch's, so that a program's own subclass of ``torch.Generator`` keeps
    its ``__init__`` and methods (a review: they were dropped)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Generator:
        # as given, to PyTorch's own, which says what is wrong with any other call
        if len(args) == 1 and _mapped(args[0]):
            args = ("cpu",)
        if "device" in kwargs and _mapped(kwargs["device"]):
            kwargs = {**kwargs, "device": "cpu"}
        return super().__new__(cls, *args, **kwargs)

    def __reduce__(self) -> Any:
        # pickled as PyTorch's own (as eager pickles a subclass's): this class's name is
        # PyTorch's, and pickle refused it as another object of that name (a review)
        _made, *rest = super().__reduce__()
        return (_TORCH_GENERATOR, *rest)


Generator.__module__ = _TORCH_GENERATOR.__module__  # "torch._C", as PyTorch names it


def attach() -> Any:
    saved = torch.Generator
    torch.Generator = Generator
    return saved


def detach(saved: Any) -> None:
    torch.Generator = saved
