"""Checking an EXEC node's arguments against its op's schema before any kernel runs.

ATen kernels trust their callers: PyTorch's own Python bindings shape every argument
before a kernel sees it (a dtype is a real ScalarType, a list of ints has the length the
schema says, a device is one that exists). Over the wire the appliance is that binding
layer, and the client chooses every value. ``torch.ops.aten.to.dtype(t, 2147483647)``
reaches a ``TypeMeta`` lookup with an enum value that does not exist; a list the kernel
indexes at ``[1]`` may have one element. So each value is checked against the schema's
declared type here, strictly and in Python, where a mistake is an exception:

- every argument the schema declares is given once (positionally or by name), or has a
  default; nothing else is given;
- tensors are real, strided tensors; ``ScalarType`` / ``Layout`` / ``MemoryFormat`` /
  ``Device`` are the decoded tagged constants (``$dtype``...), never a bare int or string,
  and only values the appliance supports (strided layout, this worker's device);
- ints and floats are numbers of the right kind, ints within ``MAX_INT``; fixed-size
  lists (``int[2]``) have that size (or are one int, which PyTorch broadcasts);
  every list is capped;
- ``Generator`` must be None (random ops are seeded per node), and types the appliance
  never takes from a client (Storage, Stream, Dimname, script objects) refuse the op.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

import torch
from torchgen.model import BaseTy, BaseType, FunctionSchema, ListType, OptionalType

from djinn.errors import InvalidArgument, UnsupportedOp

MAX_INT = 1 << 62  # a size or index beyond this is an overflow waiting to happen in C++
MAX_DIMS = 64  # PyTorch's own limit on a tensor's rank
MAX_INT_LIST = 4096  # split sizes, permutations...: far above any real use
MAX_TENSOR_LIST = 1 << 16  # a _foreach_ op over every parameter of a large model
SIZE_NAMES = frozenset({"size", "stride", "shape", "sizes", "strides"})
MEMORY_FORMATS = frozenset(
    {torch.contiguous_format, torch.channels_last, torch.channels_last_3d, torch.preserve_format}
)
# The scalar kinds a schema may declare, and the Python values each accepts.
_NUMBER = (bool, int, float, complex)


@dataclass(frozen=True, slots=True)
class Param:
    name: str
    base: str  # torchgen BaseTy name: "Tensor", "int", "ScalarType"...
    optional: bool  # T?
    is_list: bool  # T[] / T[N]
    size: int | None  # N of T[N]
    elem_optional: bool  # T?[] (Tensor?[] of index)
    list_optional: bool  # T[]? (the list itself may be None)
    kwarg_only: bool
    has_default: bool
    default: Any
    aliased: bool = False  # Tensor(a) / Tensor(a!): a view or an in-place target


@functools.cache
def params(op: Any) -> tuple[Param, ...]:
    """The schema of ``op`` as ``Param``s (cached per op). UNSUPPORTED_OP when it declares
    a type no client may supply."""
    schema = op._schema
    # torchgen's parser trips on list defaults ("int[] dims=[0,1]"); defaults are taken
    # from the JIT schema below, so they can be blanked for parsing
    text = re.sub(r"=\[[^\]]*\]", "=[]", str(schema))
    try:
        parsed = FunctionSchema.parse(text)
    except Exception as exc:  # torchgen does not know every prims schema
        raise UnsupportedOp(f"{schema.name}: schema not understood ({exc})") from None
    out = []
    for arg, jit in zip(parsed.arguments.flat_all, schema.arguments, strict=True):
        out.append(_param(schema.name, arg.name, arg.type, jit))
    return tuple(out)


def _param(op_name: str, name: str, ty: Any, jit: Any) -> Param:
    list_optional = optional = elem_optional = is_list = False
    size = None
    if isinstance(ty, OptionalType):
        optional, ty = True, ty.elem
    if isinstance(ty, ListType):
        # int[1] is "any length; one int stands for a list of one": only N >= 2 is a size
        is_list, size, ty = True, (ty.size if ty.size and ty.size > 1 else None), ty.elem
        list_optional, optional = optional, False
        if isinstance(ty, OptionalType):
            elem_optional, ty = True, ty.elem
    if not isinstance(ty, BaseType) or ty.name.name not in _CHECKS:
        raise UnsupportedOp(f"{op_name}: arguments of type {ty} are not accepted from clients")
    has_default = jit.has_default_value()
    return Param(
        name,
        ty.name.name,
        optional,
        is_list,
        size,
        elem_optional,
        list_optional,
        jit.kwarg_only,
        has_default,
        jit.default_value if has_default else None,
        jit.alias_info is not None,
    )


def bind(op: Any, args: list[Any], kwargs: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Raise INVALID_ARGUMENT unless ``op(*args, **kwargs)`` matches the schema exactly;
    return the given arguments by name."""
    ps = params(op)
    name = f"{op._schema.name}.{op._schema.overload_name or 'default'}"
    named: dict[str, Any] = {}
    positional = [p for p in ps if not p.kwarg_only]
    if len(args) > len(positional):
        raise InvalidArgument(
            f"{name}: {len(args)} positional arguments, at most {len(positional)}"
        )
    known = {p.name for p in ps}
    for key in kwargs:
        if key not in known:
            raise InvalidArgument(f"{name}: no argument named {str(key)[:64]!r}")
    for i, p in enumerate(ps):
        given = i < len(args) and not p.kwarg_only
        if given and p.name in kwargs:
            raise InvalidArgument(f"{name}: argument {p.name!r} given twice")
        if given:
            value = args[i]
        elif p.name in kwargs:
            value = kwargs[p.name]
        elif p.has_default:
            continue
        else:
            raise InvalidArgument(f"{name}: missing argument {p.name!r}")
        _check(name, p, value, device)
        named[p.name] = value
    return named


_POOL_BACKWARD = re.compile(r"aten::(max|avg)_pool[23]d(_with_indices)?_backward\b")


def _check(op_name: str, p: Param, value: Any, device: torch.device) -> None:
    where = f"{op_name}: argument {p.name!r}"
    if value is None and (p.optional or p.list_optional):
        return
    if not p.is_list:
        if p.aliased and not isinstance(value, torch.Tensor):
            raise InvalidArgument(f"{where} must be a tensor (it is written or viewed)")
        _CHECKS[p.base](where, value, device)
        return
    if p.base in ("int", "SymInt") and type(value) is int:
        _CHECKS[p.base](where, value, device)  # int[2] given one int: PyTorch repeats it
        return
    if not isinstance(value, (list, tuple)):
        raise InvalidArgument(f"{where} must be a list of {p.base}")
    cap = MAX_TENSOR_LIST if p.base == "Tensor" else MAX_INT_LIST
    if p.name in SIZE_NAMES:
        cap = MAX_DIMS
    if len(value) > cap:
        raise InvalidArgument(f"{where}: {len(value)} items, at most {cap}")
    if p.size is not None and len(value) != p.size:
        # int[2] as [k] means (k, k), which the kernels expand; [] only where the schema's
        # own default is [] (max_pool2d's stride: "same as kernel_size"), and for the
        # stride of a pooling op's backward, which autograd hands the forward's [] as it
        # was given (F.max_pool2d(x, 2)), and whose kernels read [] the same way. Anything
        # else would have a kernel index past the end of the list.
        empty_ok = p.default == [] or (p.name == "stride" and _POOL_BACKWARD.match(op_name))
        ok = p.base != "bool" and (len(value) == 1 or (not value and bool(empty_ok)))
        if not ok:
            raise InvalidArgument(f"{where} must have {p.size} items, got {len(value)}")
    for item in value:
        if item is None and p.elem_optional:
            continue
        _CHECKS[p.base](where, item, device)


def _tensor(where: str, v: Any, _device: torch.device) -> None:
    if type(v) in _NUMBER:  # PyTorch wraps a number into a 0-dim tensor (mul(t, 2.0))
        _scalar(where, v, _device)
        return
    if not isinstance(v, torch.Tensor):
        raise InvalidArgument(f"{where} must be a tensor, got {type(v).__name__}")
    if v.layout != torch.strided:
        raise InvalidArgument(f"{where}: only strided tensors run on the appliance")


def _int(where: str, v: Any, _device: torch.device) -> None:
    if type(v) not in (int, bool):
        raise InvalidArgument(f"{where} must be an int, got {type(v).__name__}")
    if not -MAX_INT <= v <= MAX_INT:
        raise InvalidArgument(f"{where}: {v} is out of range (|x| <= 2**62)")


def _float(where: str, v: Any, _device: torch.device) -> None:
    if type(v) not in (int, bool, float):
        raise InvalidArgument(f"{where} must be a float, got {type(v).__name__}")
    if type(v) is int and not -MAX_INT <= v <= MAX_INT:
        raise InvalidArgument(f"{where}: {v} is out of range")


def _bool(where: str, v: Any, _device: torch.device) -> None:
    if type(v) is not bool:
        raise InvalidArgument(f"{where} must be a bool, got {type(v).__name__}")


def _scalar(where: str, v: Any, _device: torch.device) -> None:
    if type(v) not in _NUMBER:
        raise InvalidArgument(f"{where} must be a number, got {type(v).__name__}")
    if type(v) is int and not -MAX_INT <= v <= MAX_INT:
        raise InvalidArgument(f"{where}: {v} is out of range")


def _str(where: str, v: Any, _device: torch.device) -> None:
    if type(v) is not str or len(v) > 256:
        raise InvalidArgument(f"{where} must be a string of at most 256 characters")


def _dtype(where: str, v: Any, _device: torch.device) -> None:
    from djinn.protocol.tensors import DTYPE_NAMES

    if not isinstance(v, torch.dtype) or v not in DTYPE_NAMES:
        raise InvalidArgument(f"{where} must be a dtype sent as {{'$dtype': name}}")


def _layout(where: str, v: Any, _device: torch.device) -> None:
    if v is not torch.strided:
        raise InvalidArgument(f"{where}: only the strided layout runs on the appliance")


def _memory_format(where: str, v: Any, _device: torch.device) -> None:
    if not isinstance(v, torch.memory_format) or v not in MEMORY_FORMATS:
        raise InvalidArgument(f"{where} must be a memory format sent as {{'$mf': name}}")


def _device(where: str, v: Any, device: torch.device) -> None:
    # Note: a plain string ("meta", "cuda:7") is not a device here; only {"$device": ...},
    # which the graph decoder maps to this worker's device, is.
    if not isinstance(v, torch.device) or v != device:
        raise InvalidArgument(f"{where} must be a device sent as {{'$device': name}}")


def _generator(where: str, v: Any, _device: torch.device) -> None:
    raise InvalidArgument(f"{where}: generators are not sent; random ops carry their seed")


_CHECKS = {
    BaseTy.Tensor: _tensor,
    BaseTy.int: _int,
    BaseTy.SymInt: _int,
    BaseTy.float: _float,
    BaseTy.bool: _bool,
    BaseTy.Scalar: _scalar,
    BaseTy.str: _str,
    BaseTy.ScalarType: _dtype,
    BaseTy.Layout: _layout,
    BaseTy.MemoryFormat: _memory_format,
    BaseTy.Device: _device,
    BaseTy.Generator: _generator,
}
_CHECKS = {k.name: v for k, v in _CHECKS.items()}
