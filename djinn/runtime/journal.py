"""The lineage journal's entries and what can be read from them without an appliance:
renaming handles, pairing a replayed reply with the recorded one, which entries a replay
needs (Note [lineage pruning]) and which views a cut makes again from their bases
(Note [lineage truncation]). The journal itself and its replay: lineage.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from djinn.errors import RecoveryFailed
from djinn.protocol.templates import Filled
from djinn.protocol.tensors import is_dense

if TYPE_CHECKING:
    from .remote import RemoteTensor


@dataclass
class Entry:
    """One recorded request: ``body`` as sent, ``data`` (put: ``(tensor, version)``
    pairs; graph and call: inline segments as bytes), ``out`` what it created (put:
    handles; exec: kept handles or None; call: the reply skeleton; load: name ->
    handle)."""

    kind: str
    body: Any = None
    data: list[Any] = field(default_factory=list)
    out: Any = None
    nbytes: int = 0
    replayable: bool = True
    seconds: float = 0.0  # how long it took: what replaying it costs, roughly
    ids: torch.Tensor | None = None  # call: ids read from a handle, as the worker echoed
    merged: int = 1  # call: how many decode steps it stands for (Note [kv prefill replay])
    # what it writes and which kept handles are views of which (entry_writes): worked
    # out when it is recorded, read by every cut (Note [unchanged puts])
    writes: tuple[set[str], dict[str, set[str]]] | None = field(
        default=None, repr=False, compare=False
    )


def _body(e: Entry) -> Any:
    """An entry's body, made on its first read if it was recorded unmade (a replay's:
    Note [bodies made when read], djinn/protocol/templates.py)."""
    b = e.__dict__["_body"]
    if type(b) is Filled:
        b = e.__dict__["_body"] = b.made()
    return b


def _set_body(e: Entry, body: Any) -> None:
    e.__dict__["_body"] = body


Entry.body = property(_body, _set_body)  # type: ignore[assignment]


def remap(x: Any, mapping: dict[str, str]) -> Any:
    """``x`` with every string that is an old handle or object id replaced by its new one
    (both are 128-bit random strings: nothing else can collide with them)."""
    if isinstance(x, str):
        return mapping.get(x, x)
    if isinstance(x, list):
        return [remap(v, mapping) for v in x]
    if isinstance(x, dict):
        return {k: remap(v, mapping) for k, v in x.items()}
    return x


def strings_in(x: Any, found: set[str]) -> set[str]:
    if isinstance(x, str):
        found.add(x)
    elif isinstance(x, list):
        for v in x:
            strings_in(v, found)
    elif isinstance(x, dict):
        for v in x.values():
            strings_in(v, found)
    return found


def pair_ids(old: Any, new: Any, mapping: dict[str, str]) -> None:
    """Map the handles (``$h``) and object ids (``$o``) of a recorded reply skeleton to
    those of its replay; a different structure means the replay did not reproduce it."""
    if isinstance(old, dict) and isinstance(new, dict):
        for tag in ("$h", "$o"):
            if tag in old:
                if tag not in new:
                    raise RecoveryFailed("a replayed model call returned something else")
                mapping[old[tag]] = new[tag]
        for k, v in old.items():
            if k not in ("$h", "$o"):
                pair_ids(v, new.get(k), mapping)
    elif isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        for a, b in zip(old, new, strict=True):
            pair_ids(a, b, mapping)
    elif isinstance(old, (list, dict)):
        raise RecoveryFailed("a replayed model call returned something else")


def sampled(body: dict[str, Any]) -> bool:
    """A model call whose result the appliance's own generator decides (sampling): its
    replay would not give the same values. One that carries the client's generator state
    (Note [a sampled model call], appliance/call_generator.py) draws the same numbers
    again from it."""
    kwargs = body.get("kwargs") or {}
    return bool(kwargs.get("do_sample")) and "generator" not in body


_VIEWS: dict[str, tuple[tuple[bool, ...], frozenset[int]]] = {}  # _aliases
_WRITES: dict[str, tuple[tuple[int, str], ...] | None] = {}


def _schema(op: str) -> Any:
    ns, _, rest = op.partition("::")
    name, _, overload = rest.rpartition(".")
    return getattr(getattr(getattr(torch.ops, ns), name), overload)._schema


def written_handles(node: dict[str, Any]) -> set[str]:
    """Handles a graph node writes into (its schema's ``Tensor(a!)`` arguments); every
    handle it names when the op cannot be looked up."""
    return _node_writes(node, [])


def _writes(op: str) -> tuple[tuple[int, str], ...] | None:
    if op not in _WRITES:
        try:
            _WRITES[op] = tuple(
                (i, a.name)
                for i, a in enumerate(_schema(op).arguments)
                if a.alias_info is not None and a.alias_info.is_write
            )
        except (AttributeError, RuntimeError):
            _WRITES[op] = None
    return _WRITES[op]


def _refs_in(x: Any, alias: list[set[str]], found: set[str]) -> set[str]:
    """Handles named in ``x``, and those the graph nodes it names may alias (``alias``:
    per node, handles): ``_roots_in`` without its marks for storages that are not
    handles (handles are hex strings: none starts with a mark)."""
    found.update(r for r in _roots_in(x, alias, set()) if r[:1] not in "#$?")
    return found


def _node_writes(node: dict[str, Any], alias: list[set[str]]) -> set[str]:
    """Handles a graph node writes into (its schema's ``Tensor(a!)`` arguments), also
    through the earlier nodes' outputs it writes that may alias handles (``alias``);
    every one it names when the op cannot be looked up."""
    args, kwargs = node.get("args") or [], node.get("kwargs") or {}
    where = _writes(str(node.get("op", "")))
    if where is None:
        return _refs_in([args, kwargs], alias, set())
    found: set[str] = set()
    for i, name in where:
        _refs_in(args[i] if i < len(args) else kwargs.get(name), alias, found)
    return found


def kept(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A put's source as the journal keeps it: the tensor and its version counter (Note
    [unchanged puts]). An inference tensor (made under ``torch.inference_mode()``) has no
    version counter, so a write into it cannot be seen: reading its version raised out of
    every put and checkpoint made in that mode. The journal keeps a private copy of it
    instead, a normal tensor nothing writes into."""
    if not t.is_inference():
        return t.detach(), t._version
    with torch.inference_mode(False):
        copy = t.detach().clone()
    return copy, copy._version


def unchanged_puts(
    entries: list[Entry], live: set[str] | dict[str, Any], skip: set[str] | dict[str, Any]
) -> dict[str, tuple[torch.Tensor, int]]:
    """Note [unchanged puts]: the live handles (not in ``skip``) made by a put whose
    source is as it was put and that no request has written into since: their bytes are
    the client's tensor."""
    written = written_anywhere(entries)
    out: dict[str, tuple[torch.Tensor, int]] = {}
    for e in entries:
        if e.kind != "put":
            continue
        for h, (t, version) in zip(e.out, e.data, strict=True):
            fresh = t._version == version  # not written locally either
            if h in live and h not in skip and h not in written and fresh:
                out[h] = (t, version)
    return out


def entry_writes(e: Entry) -> tuple[set[str], dict[str, set[str]]]:
    """(handles ``e`` may write into, {handle it kept as a view: handles it may alias})."""
    if e.kind == "call":
        return _handles_in(e.body) | _handles_in(e.out), {}
    if e.kind != "exec":
        return set(), {}
    written: set[str] = set()
    bases: dict[str, set[str]] = {}
    nodes = e.body.get("nodes", [])
    alias: list[set[str]] = []  # per node: the handles its outputs may alias
    for n in nodes:
        written |= _node_writes(n, alias)
        args, kwargs = n.get("args") or [], n.get("kwargs") or {}
        views = view_outputs(str(n.get("op", "")))
        alias.append(_refs_in([args, kwargs], alias, set()) if any(views) else set())
    for ref, kept in zip(e.body.get("keep", []), e.out or [], strict=False):
        if kept is not None and isinstance(ref, dict):
            bases.setdefault(kept, set()).update(_refs_in(ref, alias, set()) - {kept})
    return written, bases


def written_anywhere(entries: list[Entry]) -> set[str]:
    """Note [unchanged puts]: every handle the journal's requests may have written into,
    directly or through a view (in the same graph, or a view kept as a handle and
    written by a later one). A put whose handle is not among them still holds the bytes
    it was put with, so a cut keeps the put instead of reading the value back. Model
    calls count as writing every handle they name; an op that cannot be looked up, as
    writing everything it names."""
    bases: dict[str, set[str]] = {}  # a handle kept as a view -> handles it may alias
    written: set[str] = set()
    for e in entries:
        if e.writes is None:
            e.writes = entry_writes(e)
        written |= e.writes[0]
        for kept, of in e.writes[1].items():
            bases.setdefault(kept, set()).update(of)
    # a view written is its bases written (and theirs, ...)
    todo = list(written)
    while todo:
        for base in bases.get(todo.pop(), ()):
            if base not in written:
                written.add(base)
                todo.append(base)
    return written


def needed(entries: list[Entry], live: set[str]) -> list[bool]:
    """Note [lineage pruning]: which entries a replay must run for the ``live`` handles
    and objects. Walking back from the end, an entry is needed when it makes or writes
    into something needed later, and then what it reads is needed too. Aliasing is
    kept whole: every id of a graph that makes a view, and every id a model call names
    or returns (a cache, its outputs), are one group, needed together. Registrations,
    loads, puts and frees are always kept (puts are lazy, frees of what was not made
    are skipped). A finished sequence's decode steps, or an abandoned branch, cost no
    replay."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.get(x, x) != x:
            parent[x] = parent.get(parent[x], parent[x])
            x = parent[x]
        return x

    def union(ids: set[str]) -> None:
        it = iter(ids)
        first = next(it, None)
        if first is not None:
            root = find(first)
            for other in it:
                r = find(other)
                if r != root:
                    parent[r] = root

    refs: list[tuple[set[str], set[str]]] = []  # (made or written, read) per entry
    for e in entries:
        if e.kind == "exec":
            nodes = e.body.get("nodes", [])
            made = {h for h in e.out if h is not None}
            written: set[str] = set()
            aliasing = False
            for n in nodes:
                written |= written_handles(n)
                aliasing = aliasing or any(view_outputs(str(n.get("op", ""))))
            read = _handles_in(e.body)
            if aliasing:
                union(made | read)
            refs.append((made | written, read))
        elif e.kind == "call":
            ids = _handles_in(e.body) | _objects_in(e.body) | _handles_in(e.out)
            ids |= _objects_in(e.out)
            union(ids)
            refs.append((ids, ids))
        else:
            refs.append((set(), set()))
    want = {find(x) for x in live}
    keep = [True] * len(entries)
    for i in range(len(entries) - 1, -1, -1):
        if entries[i].kind not in ("exec", "call"):
            continue
        out, read = refs[i]
        if any(find(x) in want for x in out):
            want |= {find(x) for x in read}
        else:
            keep[i] = False
    return keep


def _objects_in(x: Any, found: set[str] | None = None) -> set[str]:
    found = set() if found is None else found
    if isinstance(x, dict):
        if "$o" in x:
            found.add(x["$o"])
        for v in x.values():
            _objects_in(v, found)
    elif isinstance(x, list):
        for v in x:
            _objects_in(v, found)
    return found


def view_outputs(op: str) -> tuple[bool, ...]:
    """Per output of ``op`` (``aten::t.default``), whether it may alias an input."""
    return _aliases(op)[0]


def written_outputs(op: str) -> frozenset[int]:
    """The outputs of ``op`` that are an argument it writes (``add_``'s ``self``, an
    ``out=``): made again by running the op, the write would happen twice (found by
    review: after a cut and a lost worker, ``w.add_(g)`` kept as its own handle through
    ``Session.execute`` had added ``g`` twice). Such an output is no view a cut can make
    again from its bases."""
    return _aliases(op)[1]


def _aliases(op: str) -> tuple[tuple[bool, ...], frozenset[int]]:
    """``op``'s outputs that may alias an input, and those that are an input it writes,
    read once from its schema's returns; an op we cannot name: assume the worst."""
    known = _VIEWS.get(op)
    if known is None:
        try:
            returns = _schema(op).returns
            known = (
                tuple(r.alias_info is not None for r in returns),
                frozenset(
                    k for k, r in enumerate(returns) if r.alias_info and r.alias_info.is_write
                ),
            )
        except (AttributeError, RuntimeError):
            known = ((True,) * 8, frozenset(range(8)))
        _VIEWS[op] = known
    return known


def mark_views(body: dict[str, Any], kept: list[Any]) -> None:
    """Handles that may share storage with another: made again from their bases after
    a cut when the op that made them took handles only, else a cut waits for them."""
    apply_views(view_kinds(body, [None if k is None else k.handle for k in kept]), kept)


def view_kinds(body: dict[str, Any], kept: list[str | None]) -> list[Any]:
    """Per kept output (``kept``: its handle, None if its node never ran): None if it
    is no view; ``(node, ref)``, the node that makes it again from handles; "private"
    (Note [private views]: the same tensor if read back and put again, when dense); or
    "view"."""
    nodes, keep = body.get("nodes", []), body.get("keep", [])
    private: set[int] | None = None
    # this graph's outputs kept as handles: a view of one is made again from it
    named = {
        (r["$v"], r.get("i")): k
        for r, k in zip(keep, kept, strict=False)
        if k is not None and isinstance(r, dict) and type(r.get("$v")) is int
    }
    out: list[Any] = []
    for i, (ref, handle) in enumerate(zip(keep, kept, strict=False)):
        out.append(None)
        if handle is None or not isinstance(ref, dict) or "$v" not in ref:
            continue
        op = str(nodes[ref["$v"]].get("op", ""))
        views = view_outputs(op)
        k = ref.get("i", 0)
        if k >= len(views) or views[k]:
            node = _on_handles(nodes[ref["$v"]], named)
            if k not in written_outputs(op) and _from_handles_only(node):
                # the node, and how the graph named this output (``i`` only when multi)
                out[i] = (node, {**ref, "$v": 0})
                continue
            if private is None:
                private = private_views(body, kept)
            out[i] = "private" if i in private else "view"
    return out


def apply_views(kinds: list[Any], kept: list[Any]) -> None:
    """Set each kept RemoteTensor's ``view`` as ``view_kinds`` found."""
    for kind, remote in zip(kinds, kept, strict=False):
        if kind is None or remote is None:
            continue
        if isinstance(kind, tuple):
            remote.view = ({**kind[0]}, {**kind[1]})
        else:  # Note [private views]: read back and put again, it is the same tensor
            dense = is_dense(list(remote.shape), list(remote.strides))
            remote.view = not (kind == "private" and dense)


class GraphFacts:
    """Note [journal facts of a template]: what the journal works out of a graph (which
    handles it may write, which kept handles are views of which, ``entry_writes`` and
    ``view_kinds``) walks every node, and depends only on the graph's template and on
    which of its handles are one: a replayed training step paid about 1.5 ms a call for
    it (``benchmarks/training_step.py``). A template's facts are worked out once, on its
    body with every input and kept handle renamed to a placeholder (``@3``, ``@k3``), and
    each later call renames them to its own handles. Only bodies whose inputs are
    distinct handles use them (a template's inputs are, by construction)."""

    def __init__(
        self, body: dict[str, Any], inputs: list[str], kept: list[str], scalars: list[float]
    ) -> None:
        names = {h: f"@{j}" for j, h in enumerate(inputs)}
        names.update({h: f"@k{j}" for j, h in enumerate(kept)})
        generic = remap(body, names)
        holders = [f"@k{j}" for j in range(len(kept))]
        self.writes = entry_writes(Entry("exec", generic, out=holders))
        self.kinds = view_kinds(generic, list(holders))
        self.inputs, self.kept = len(inputs), len(kept)
        # a node that makes a view again holds this body's floats, which the template
        # leaves out: the facts hold only for these floats (found by review: a view kept
        # from a graph whose floats change at every call was made again with the first's)
        remade = [k[0] for k in self.kinds if isinstance(k, tuple)]
        self.scalars = list(scalars) if _has_float(remade) else None

    def fits(self, inputs: list[str], kept: list[str | None], scalars: list[float]) -> bool:
        return (
            len(inputs) == self.inputs
            and len(kept) == self.kept
            and distinct_handles(inputs, kept)
            and (self.scalars is None or self.scalars == list(scalars))
        )

    def of(self, inputs: list[str], kept: list[str]) -> tuple[Any, list[Any]]:
        """(``entry_writes``, ``view_kinds``) of the call with these handles."""
        names = {f"@{j}": h for j, h in enumerate(inputs)}
        names.update({f"@k{j}": h for j, h in enumerate(kept)})
        written, bases = self.writes
        writes = (
            {names.get(h, h) for h in written},
            {names[k]: {names.get(h, h) for h in v} for k, v in bases.items()},
        )
        kinds = [(_renamed(k[0], names), k[1]) if isinstance(k, tuple) else k for k in self.kinds]
        return writes, kinds


def _has_float(x: Any) -> bool:
    if type(x) is float:
        return True
    if isinstance(x, dict):
        return any(_has_float(v) for v in x.values())
    if isinstance(x, list):
        return any(_has_float(v) for v in x)
    return False


def distinct_handles(inputs: list[str], kept: list[str | None]) -> bool:
    """Whether a graph's inputs and kept handles are all different handles, none of them
    missing (a node that never ran): what ``GraphFacts`` needs to rename them."""
    names = [*inputs, *kept]
    return None not in kept and len(set(names)) == len(names)


def _renamed(x: Any, names: dict[str, str]) -> Any:
    """``x`` with the handles (``{"$h": ...}``) ``names`` renames: a string argument that
    happens to spell a placeholder stays as it is."""
    if isinstance(x, list):
        return [_renamed(v, names) for v in x]
    if isinstance(x, dict):
        if len(x) == 1 and isinstance(x.get("$h"), str):
            return {"$h": names.get(x["$h"], x["$h"])}
        return {k: _renamed(v, names) for k, v in x.items()}
    return x


def _on_handles(node: dict[str, Any], named: dict[tuple[int, Any], str]) -> dict[str, Any]:
    """``node`` with its inputs that are outputs of the same graph kept as handles
    (``named``: (node, output) -> handle) named by those handles."""

    def sub(x: Any) -> Any:
        if isinstance(x, dict):
            if type(x.get("$v")) is int and (x["$v"], x.get("i")) in named:
                return {"$h": named[(x["$v"], x.get("i"))]}
            return {k: sub(v) for k, v in x.items()}
        if isinstance(x, list):
            return [sub(v) for v in x]
        return x

    return {k: sub(v) if k in ("args", "kwargs") else v for k, v in node.items()}


def private_views(body: dict[str, Any], kept: list[Any]) -> set[int]:
    """Note [private views]: which kept outputs of a graph (by position in ``keep``)
    are views only of storage this graph made and kept nowhere else: no handle, no
    other kept output shares their bytes, so their value read back and put again is
    the same tensor to every later request."""
    nodes, keep = body.get("nodes", []), body.get("keep", [])
    roots: list[set[str]] = []  # per node: the storages its outputs may alias
    for j, n in enumerate(nodes):
        views = view_outputs(str(n.get("op", "")))
        mine = {f"#{j}"}
        roots.append(
            _roots_in([n.get("args"), n.get("kwargs")], roots, mine) if any(views) else mine
        )

    def of(ref: Any) -> set[str]:
        if not isinstance(ref, dict) or type(ref.get("$v")) is not int:
            return _roots_in(ref, roots, set()) | {"?"}  # a handle kept again, or unknown
        j = ref["$v"]
        if not 0 <= j < len(nodes):
            return {"?"}
        views, k = view_outputs(str(nodes[j].get("op", ""))), ref.get("i", 0)
        return roots[j] if k >= len(views) or views[k] else {f"#{j}"}

    each = [of(ref) if r is not None else set() for ref, r in zip(keep, kept, strict=False)]
    out: set[int] = set()
    for i, mine in enumerate(each):
        others = set().union(*(o for k, o in enumerate(each) if k != i))
        if mine and all(x.startswith("#") for x in mine) and not mine & others:
            out.add(i)
    return out


def _roots_in(x: Any, roots: list[set[str]], found: set[str]) -> set[str]:
    """The storages ``x`` names: handles by name, inline tensors by segment, other
    nodes' outputs by what ``roots`` says of them."""
    if isinstance(x, dict):
        if "$h" in x:
            found.add(str(x["$h"]))
        elif "$t" in x:
            found.add(f"$t{x['$t']}")
        elif "$v" in x:
            j = x["$v"]
            found |= roots[j] if type(j) is int and 0 <= j < len(roots) else {"?"}
        for v in x.values():
            _roots_in(v, roots, found)
    elif isinstance(x, list):
        for v in x:
            _roots_in(v, roots, found)
    return found


def _from_handles_only(node: dict[str, Any]) -> bool:
    """Whether a graph node's tensor inputs are all handles (no other node's output, no
    inline bytes): it can run alone again on the handles' replayed twins."""

    def ok(x: Any) -> bool:
        if isinstance(x, dict):
            if "$v" in x or "$t" in x:
                return False
            return all(ok(v) for v in x.values())
        if isinstance(x, list):
            return all(ok(v) for v in x)
        return True

    return ok(node.get("args")) and ok(node.get("kwargs"))


def _remade_views(live: dict[str, RemoteTensor]) -> dict[str, tuple[dict, dict]] | None:
    """The live views a cut makes again from their bases, in an order that makes bases
    first: ``{handle: (node, its keep ref)}``; None when one cannot be (made by an op
    that took more than handles, or from a base no longer held: two such views may share
    it, and restored apart they would not)."""
    views = {h: r.view for h, r in live.items() if r.view}
    if any(v is True for v in views.values()):
        return None
    ordered: dict[str, tuple[dict, dict]] = {}
    while len(ordered) < len(views):
        progress = False
        for h, (node, k) in views.items():
            if h in ordered:
                continue
            bases = {x for x in _handles_in(node) if x != h}
            if not bases <= set(live):
                return None
            if all(b not in views or b in ordered for b in bases):
                ordered[h] = (node, k)
                progress = True
        if not progress:
            return None
    return ordered


def _handles_in(x: Any, found: set[str] | None = None) -> set[str]:
    found = set() if found is None else found
    if isinstance(x, dict):
        if "$h" in x:
            found.add(x["$h"])
        for v in x.values():
            _handles_in(v, found)
    elif isinstance(x, list):
        for v in x:
            _handles_in(v, found)
    return found
