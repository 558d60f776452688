"""Where a recorded call's inputs and gradients come from (Note [replayable functions] in
replayable.py): the argument, the tensor that held it, or a ``.grad``; and the gradients
the call leaves in ``.grad``, which each replay puts there anew."""

from __future__ import annotations

import gc
import sys
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


def only_views_hold(cells: list[Any]) -> bool:
    """Whether the tensors bound by ``cells`` are each held by nothing but views.

    Note [a returned view's base]: ``return x.view(...)`` (GPT-2's last hidden state, a
    slice of logits) keeps ``x`` alive as the view's ``_base``, and ``x`` looked like a
    tensor the call made and kept without returning it, which a replay could not set:
    such calls were never replayed. A view of a view can hold the view between as well
    (the slice's reverse view function keeps its input). Such tensors are held by C++
    alone, which Python's collector does not see as a referrer; a tensor the program
    keeps (``self.cache = x``, ``box[0] = x[2:]``) has one, a container or a frame. So
    a tensor the call made and did not return, that shares its storage with one it
    returns, is looked for among the collector's objects, and then whatever refers to it
    (heap walks, made at a recording only, and only then). A reference count cannot
    tell: what C++ ownership adds to it differs between kinds of tensor subclass (a
    review found a count calibrated on another kind one too lenient, and a kept view
    replayed stale)."""
    from .lazy import LazyTensor

    want = {id(c) for c in cells}
    found: list[Any] = []
    # the call made them: young, most likely, and the young generations are small (the
    # whole heap was 390,000 objects, 118 ms a walk, with transformers imported)
    for generation in range(3):
        # type(), not isinstance: a module proxy warns when its __class__ is read
        found += [
            o
            for o in gc.get_objects(generation)
            if issubclass(type(o), LazyTensor) and id(o.__dict__.get("_b")) in want
        ]
        if len(found) == len(want):
            break
    else:
        return False
    here = sys._getframe()
    holders = [r for r in gc.get_referrers(*found) if r is not found and r is not here]
    return not holders


def left_in_grad(
    nodes: list[Any], returned: set, owners: dict[int, Any], shared: set[int] = frozenset()
) -> dict:
    """The outputs it made that stay alive in ``.grad`` (each replay puts new ones there),
    by output; any other it did not return is a Miss, but for one only the views it
    returns hold (Note [a returned view's base]). ``shared``: the ids of the
    ``Storage``s of what it returns."""
    from .lazy import spec_of

    left: dict[tuple[int, int], tuple[Any, tuple]] = {}
    maybe: list[tuple[Any, str]] = []
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
                if owner is None and cell.storage is not None and id(cell.storage) in shared:
                    maybe.append((cell, n.name))  # a view between, or kept
                    continue
                if owner is None or (id(n), k) in left:  # self.cache = x: a replay could not
                    # set it (not final: an optimizer's first step makes its state, later
                    # ones update it in place)
                    raise Miss(f"it keeps a tensor it made that it does not return ({n.name})")
                left[(id(n), k)] = (owner, spec_key(spec_of(owner._grad)))
    if maybe and not only_views_hold([cell for cell, _ in maybe]):
        raise Miss(f"it keeps a tensor it made that it does not return ({maybe[0][1]})")
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
