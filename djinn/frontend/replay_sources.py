"""Where a recorded call's inputs and gradients come from (Note [replayable functions] in
replayable.py): the argument, the tensor that held it, or a ``.grad``; and the gradients
the call leaves in ``.grad``, which each replay puts there anew."""

from __future__ import annotations

import weakref
from typing import Any

from djinn.runtime.remote import RemoteTensor

from . import trace as trace_mod
from .meta import TensorSpec
from .nodes import Pending
from .replay_key import Miss


def grad_owners(tensors: list[Any]) -> dict[int, Any]:
    """id of a ``.grad``'s Binding -> the tensor whose gradient it is."""
    from .lazy import LazyTensor

    owners: dict[int, Any] = {}
    for t in tensors:
        grad = t._grad if t.is_leaf else None
        if isinstance(grad, LazyTensor):
            owners[id(grad.__dict__["_b"])] = t
    return owners


def left_in_grad(nodes: list[Any], returned: set, owners: dict[int, Any]) -> dict:
    """The outputs it made that stay alive in ``.grad`` (each replay puts new ones there),
    by output; any other it did not return is a Miss."""
    from .lazy import spec_of

    left: dict[tuple[int, int], tuple[Any, tuple]] = {}
    for n in nodes:
        for k in range(n.nout):
            for w in n.holders[k]:
                cell = w()
                if cell is None or not isinstance(cell.ref, Pending) or cell.ref.node is not n:
                    continue
                owner = owners.get(id(cell))
                if (id(n), k) in returned:  # a returned gradient is in .grad too
                    if owner is not None and (id(n), k) not in left:
                        left[(id(n), k)] = (owner, spec_key(spec_of(owner._grad)))
                    continue
                if owner is None or (id(n), k) in left:  # self.cache = x: a replay could not
                    # set it (not final: an optimizer's first step makes its state, later
                    # ones update it in place)
                    raise Miss(f"it keeps a tensor it made that it does not return ({n.name})")
                left[(id(n), k)] = (owner, spec_key(spec_of(owner._grad)))
    return left


def sources_of(
    inputs: list[str],
    tensors: list[Any],
    reads: dict[Any, list[tuple[Any, Any]]],
    owners: dict[int, Any],
    written: set[str],
) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]]]:
    """Where each input of the graph comes from, and what its in-place ops write."""
    by_arg: dict[str, int] = {}
    for i, t in enumerate(tensors):
        ref = trace_mod.resolved(t._ref)
        if isinstance(ref, RemoteTensor):
            by_arg.setdefault(ref.handle, i)
    args = {id(t) for t in tensors}
    sources: list[tuple[str, Any]] = []
    changed: list[tuple[str, Any]] = []
    for h in inputs:
        entries = reads.get(h, [])
        if h in by_arg:
            if any(id(t) not in args for _cell, t in entries):
                raise Miss("an argument is also a tensor it reads by another name")
            sources.append(("arg", by_arg[h]))
            if h in written:
                changed.extend(("arg", i) for i, t in enumerate(tensors) if id(t) in {
                    id(x) for _c, x in entries})  # fmt: skip
            continue
        cells = [cell for cell, _t in entries]
        if not cells or not all(holds(c, h) for c in cells):
            raise Miss("an input's source is unknown")
        owner = next((owners[id(c)] for c in cells if id(c) in owners), None)
        if owner is not None:  # a gradient: read from .grad as it is then
            sources.append(("grad", owner))
        else:
            sources.append(("held", [weakref.ref(c) for c in cells]))
        if h in written:
            changed.extend(("tensor", t) for _c, t in entries)
    return sources, changed


def holds(cell: Any, handle: str) -> bool:
    """A Binding, alive, still bound to ``handle``."""
    return cell is not None and isinstance(cell.ref, RemoteTensor) and cell.ref.handle == handle


def spec_key(spec: TensorSpec) -> tuple:
    return (spec.dtype, tuple(spec.shape), tuple(spec.stride), spec.offset)
