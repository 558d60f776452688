"""Tagged values (pure): how the arguments of graph nodes and model calls are written as
JSON, and read back. One codec for the client (``frontend/trace.py``,
``frontend/remote_module.py``) and the appliance (``executor/graph.py``, ``skeleton.py``).

Plain JSON carries None, booleans, integers, strings, finite floats and lists. Anything
else is an object with one ``$`` key (the table in ``graph.py``): ``{"$dtype": ...}``,
``{"$device": ...}``, ``{"$mf": ...}``, ``{"$layout": ...}``, ``{"$float": "inf"}``,
``{"$complex": [re, im]}``, ``{"$tuple": [...]}`` (model calls, where a tuple is not a
list), and the references each side resolves itself: ``$h`` (a handle), ``$v`` (a node's
output), ``$o`` (a remote object), ``$t`` (an inline tensor, ``inline_tensor``).
Decoding never evaluates anything: an unknown tag is INVALID_ARGUMENT.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from djinn.errors import InvalidArgument, UnsupportedOp

from .graph import LAYOUTS, MEMORY_FORMATS, encode_float
from .tensors import dtype_name, from_wire

NOT_A_CONSTANT = object()


def encode_constant(x: Any) -> Any:
    """JSON for a constant, or ``NOT_A_CONSTANT``."""
    if x is None or isinstance(x, (bool, int, str)):
        return x
    if isinstance(x, float):
        return encode_float(x)
    if isinstance(x, torch.dtype):
        return {"$dtype": dtype_name(x)}
    if isinstance(x, torch.device):
        return {"$device": str(x)}
    if isinstance(x, torch.memory_format):
        return {"$mf": str(x).removeprefix("torch.")}
    if isinstance(x, torch.layout):
        return {"$layout": str(x).removeprefix("torch.")}
    if isinstance(x, complex):
        return {"$complex": [x.real, x.imag]}
    return NOT_A_CONSTANT


def encode(x: Any, leaf: Callable[[Any], Any], *, tuples: bool = False) -> Any:
    """JSON for ``x``. ``leaf(x)`` encodes what only the caller knows (tensors, handles,
    pending values) or returns ``NOT_A_CONSTANT``; ``tuples`` keeps tuples apart from
    lists (model calls) instead of sending both as lists (op arguments)."""
    kind = type(x)
    if kind is int or kind is bool or kind is str or x is None:  # most arguments: as is
        return x
    if kind is list:  # shapes, dims, tensor lists: no leaf is a list
        return [encode(v, leaf, tuples=tuples) for v in x]
    done = leaf(x)
    if done is not NOT_A_CONSTANT:
        return done
    value = encode_constant(x)
    if value is not NOT_A_CONSTANT:
        return value
    if isinstance(x, tuple) and tuples:
        return {"$tuple": [encode(v, leaf, tuples=tuples) for v in x]}
    if isinstance(x, (list, tuple)):
        return [encode(v, leaf, tuples=tuples) for v in x]
    if isinstance(x, dict):
        return {str(k): encode(v, leaf, tuples=tuples) for k, v in x.items()}
    raise UnsupportedOp(f"cannot send a {type(x).__name__} argument to the appliance")


def decode_constant(x: dict[str, Any], device: torch.device) -> tuple[bool, Any]:
    """A one-key tagged constant (``{"$dtype": ...}``...) -> (True, value); a plain dict
    -> (False, None); an unknown ``$`` tag -> INVALID_ARGUMENT."""
    from .tensors import parse_dtype

    if len(x) == 1:
        ((tag, value),) = x.items()
        if tag == "$dtype":
            return True, parse_dtype(value)
        if tag == "$device":
            return True, device  # every device the client names is this worker's
        if tag == "$mf" and value in MEMORY_FORMATS:
            return True, getattr(torch, value)
        if tag == "$layout" and value in LAYOUTS:
            return True, getattr(torch, value)
        if tag == "$float" and value in ("inf", "-inf", "nan"):
            return True, float(value)
        if tag == "$complex" and isinstance(value, list) and len(value) == 2:
            try:
                return True, complex(float(value[0]), float(value[1]))
            except (TypeError, ValueError):
                raise InvalidArgument("$complex must hold two numbers") from None
    if any(isinstance(k, str) and k.startswith("$") for k in x):
        raise InvalidArgument(f"unknown tagged constant {sorted(map(str, x))!r}")
    return False, None


def inline_tensor(x: dict[str, Any], segments: list[memoryview], device: torch.device) -> Any:
    """The tensor ``{"$t": k, "desc": ...}`` names: payload segment ``k``, on ``device``
    unless it is marked ``"host": true`` (kept in host memory)."""
    k = x["$t"]
    if type(k) is not int or not 0 <= k < len(segments):
        raise InvalidArgument(f"no payload segment {k!r}")
    seg = segments[k]
    raw = (
        torch.frombuffer(seg, dtype=torch.uint8)
        if len(seg)
        else torch.empty(0, dtype=torch.uint8, device="cpu")
    )
    t = from_wire(x.get("desc"), raw)
    return t if x.get("host") is True else t.to(device)
