"""Where a recorded call's inputs and gradients come from (Note [replayable functions] in
replayable.py): the argument, the tensor that held it, or a ``.grad``; and the gradients
the call leaves in ``.grad``, which each replay puts there anew."""

from __future__ import annotations

import gc
import sys
import weakref
from typing import Any

import torch

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


class _Probe(torch.Tensor):
    """A tensor subclass, as LazyTensor is, to count what holds a base only its views do."""


def _python_refs(t: torch.Tensor) -> int:
    """``t``'s reference count, ``t`` held by one local of the caller."""
    return sys.getrefcount(t)


def _views_only() -> int:
    """What ``_python_refs`` counts for a tensor nothing but its views holds: C++ holds
    it then (a view's autograd meta), which Python's count does not show. Measured on a
    probe, not assumed, so that another interpreter's counting gives its own figure."""
    view = torch.empty(1).as_subclass(_Probe).view(1)
    base = view._base
    return _python_refs(base)


_VIEWS_ONLY = _views_only()


def held_by_views(leaves: list[Any]) -> set[int]:
    """ids of the Bindings of the bases of the views it returns that nothing else holds.

    Note [a returned view's base]: ``return x.view(...)`` (GPT-2's last hidden state, a
    slice of logits) keeps ``x`` alive as the view's ``_base``, and ``x`` looked like a
    tensor the call made and kept without returning it, which a replay could not set:
    such calls were never replayed. A tensor held only by the views it returns is reached
    only through them: not kept. One held by anything else as well (``self.cache = x``)
    is. A view of a view can hold the view between too (``x.unsqueeze(0)[..., :2]``: the
    slice's reverse view function keeps its input), which ``_base`` does not name: a
    tensor left that shares its storage with a returned one is looked for among the
    collector's objects (``only_views_hold``), a heap walk made only then."""
    from .lazy import LazyTensor

    held = set()
    for x in leaves:
        if isinstance(x, LazyTensor) and x._is_view():
            base = x._base
            if _python_refs(base) <= _VIEWS_ONLY:
                held.add(id(base.__dict__["_b"]))
    return held


def only_views_hold(cells: list[Any]) -> bool:
    """Whether the tensors bound by ``cells`` are each held by nothing but views."""
    from .lazy import LazyTensor

    want = {id(c) for c in cells}
    found = 0
    objects = gc.get_objects()
    for o in objects:
        # type(), not isinstance: a module proxy warns when its __class__ is read
        if issubclass(type(o), LazyTensor) and id(o.__dict__.get("_b")) in want:
            if _python_refs(o) - 1 > _VIEWS_ONLY:  # less ``objects``' own reference
                return False
            found += 1
    return found == len(want)


def left_in_grad(
    nodes: list[Any],
    returned: set,
    owners: dict[int, Any],
    viewed: set[int] = frozenset(),
    shared: set[int] = frozenset(),
) -> dict:
    """The outputs it made that stay alive in ``.grad`` (each replay puts new ones there),
    by output; any other it did not return is a Miss, but for one only the views it
    returns hold (Note [a returned view's base]). ``viewed``: the Bindings of such bases
    (``held_by_views``); ``shared``: the ids of the ``Storage``s of what it returns."""
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
                if owner is None and id(cell) in viewed:
                    continue  # reached only through a view it returns
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
