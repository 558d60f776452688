"""Op-graph wire format (pure): how a graph of named aten ops is written as JSON.

An EXEC body holds::

    {"nodes": [{"op": "aten::add.Tensor", "args": [...], "kwargs": {...}}, ...],
     "keep":  [ref, ...],     # values to keep on the appliance as new handles
     "fetch": [ref, ...]}     # values whose bytes come back in the reply

Values inside args/kwargs are plain JSON (numbers, strings, booleans, null, lists) or one
of these tagged objects, each with exactly one ``$`` key:

    {"$h": "<handle>"}                 a tensor the session already holds
    {"$v": n} / {"$v": n, "i": k}      output of node n (element k of a tuple output)
    {"$t": seg, "desc": {...}}         a tensor sent inline as payload segment ``seg``
    {"$t": seg, "desc": {...}, "host": true}   ... kept in host memory, not moved to the
                                       device (the CPU ``scalars`` of ``_foreach_*.Tensor``)
    {"$dtype": "float32"}   {"$device": "cpu"}   {"$mf": "channels_last"}
    {"$layout": "strided"}  {"$complex": [re, im]}   {"$float": "inf" | "-inf" | "nan"}

Nothing else is executable: op names are resolved only within ``torch.ops.aten`` and
``torch.ops.prims`` by the appliance.
"""

from __future__ import annotations

import math
import re
from typing import Any

OP_NAME = re.compile(r"^(aten|prims)::([a-z_][a-z0-9_]*)(?:\.([a-zA-Z_][a-zA-Z0-9_]*))?$")
MAX_NODES = 100_000
MAX_DEPTH = 16

MEMORY_FORMATS = ("contiguous_format", "channels_last", "channels_last_3d", "preserve_format")
LAYOUTS = ("strided", "sparse_coo")


def parse_op_name(name: Any) -> tuple[str, str, str]:
    """(namespace, op, overload) or ValueError."""
    m = OP_NAME.match(name) if isinstance(name, str) else None
    if not m:
        raise ValueError(f"not an aten/prims op name: {name!r}")
    return m.group(1), m.group(2), m.group(3) or "default"


def encode_float(x: float) -> Any:
    if math.isfinite(x):
        return x
    return {"$float": "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")}
