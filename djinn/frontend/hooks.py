"""Module paths for captured ops, from global forward hooks (``extension_points.py``
attaches them while a ``capture()`` block is open).

Each thread keeps a stack of the modules whose ``forward`` is running; an op captured
meanwhile is tagged with the dotted path (``GPT2Model.h.0.attn.c_attn``). Names are the
attribute names under the parent, found once per module and cached.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

_local = threading.local()
_names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _stack() -> list[str]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def pre(module: torch.nn.Module, _args: Any) -> None:
    stack = _stack()
    name = _names.get(module)
    if name is None:
        name = type(module).__name__
        parent = getattr(_local, "parents", None)
        if stack and parent:
            # search below the calling module: blocks in a ModuleList are `h.0`, not `0`
            for child_name, child in parent[-1].named_modules():
                if child is module and child_name:
                    name = child_name
                    break
        _names[module] = name
    path = f"{stack[-1]}.{name}" if stack else name
    stack.append(path)
    parents = getattr(_local, "parents", None)
    if parents is None:
        parents = _local.parents = []
    parents.append(module)


def post(_module: torch.nn.Module, _args: Any, _out: Any) -> None:
    stack = _stack()
    if stack:
        stack.pop()
        _local.parents.pop()


def module_path() -> str:
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else ""
