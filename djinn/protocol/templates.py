"""Graph templates (pure): an op graph with its handles and floating-point scalars taken
out, so that a repeated graph travels as a fingerprint plus what changed.

Note [graph templates]: a training step or a model forward sends the same graph again
and again with other tensors and, for optimizers, other scalars (a learning rate, bias
corrections). Its *template* is the graph with every ``{"$h": handle}`` replaced by
``{"$in": j}`` (the j-th distinct handle) and every float by ``{"$s": k}``; everything
else (ops, integer arguments such as shapes and dims, inline tensors' descriptions,
node references) is its structure. The fingerprint is a hash of the template. The
client sends a graph whole the first time, asking the appliance to keep it; the
appliance computes the template and fingerprint itself from what it received (a client
cannot make it keep something else under a fingerprint) and says which. A repeat then
sends ``{"graph": fingerprint, "inputs": [...], "scalars": [...]}``: its bytes do not
grow with the number of ops. The appliance puts the values back in and runs the graph
exactly as if it had been sent whole, every check included.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

import orjson

from djinn.errors import InvalidArgument

PARTS = ("nodes", "keep", "fetch")


def template(body: dict[str, Any]) -> tuple[dict[str, Any], list[str], list[float]]:
    """(template, inputs, scalars) of a graph body's nodes, keep and fetch."""
    inputs: dict[str, int] = {}
    scalars: list[float] = []

    def walk(x: Any) -> Any:
        kind = type(x)
        if kind is list:
            return [walk(v) for v in x]
        if kind is dict:
            handle = x.get("$h")
            if isinstance(handle, str) and len(x) == 1:
                return {"$in": inputs.setdefault(handle, len(inputs))}
            if "$in" in x or "$s" in x:  # a template's own tags: a graph cannot hold them
                raise InvalidArgument("$in and $s are reserved for graph templates")
            return {k: walk(v) for k, v in x.items()}
        if kind is float:
            scalars.append(x)
            return {"$s": len(scalars) - 1}
        return x

    tpl = {part: walk(body.get(part, [])) for part in PARTS}
    return tpl, list(inputs), scalars


def fingerprint(tpl: dict[str, Any]) -> str:
    """A hash of the template's canonical JSON (sorted keys). orjson writes it about 8x
    faster than ``json`` (0.08 against 0.6 ms for a 328-op training graph, hashed for
    every request); an integer past 64 bits, which orjson refuses, takes ``json``. Client
    and appliance call this same function, so they agree on every template."""
    try:
        text = orjson.dumps(tpl, option=orjson.OPT_SORT_KEYS)
    except TypeError:  # orjson.JSONEncodeError is one
        text = json.dumps(tpl, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    return hashlib.blake2b(text, digest_size=16).hexdigest()


def instantiate(tpl: dict[str, Any], inputs: Any, scalars: Any) -> dict[str, Any]:
    """The graph body ``tpl`` stands for, with ``inputs`` and ``scalars`` put back;
    INVALID_ARGUMENT if they do not fit it."""
    walk = _filler(inputs, scalars)
    return {part: walk(tpl[part]) for part in PARTS}


def instantiator(tpl: dict[str, Any]) -> Callable[[Any, Any], dict[str, Any]]:
    """``instantiate`` for the many calls of one template (a client's replays, Note
    [replayable functions]). Where each input and scalar goes is found once: a body
    copies only the lists and dicts on the way to one and shares everything else with
    the template. Walking every argument of every node that read a parameter was a fifth
    of a replayed training step's client CPU. What it makes is read, never written (the
    journal's rewrites, ``remap``, make new bodies)."""
    # per part: its items, and (index, sites) of those that hold a slot; a body's list is
    # a copy of the items with those put back (most nodes hold none: a C-speed copy)
    parts = {
        part: (tpl[part], [(i, site) for i, v in enumerate(tpl[part]) if (site := _sites(v))])
        for part in PARTS
    }

    def make(inputs: Any, scalars: Any) -> dict[str, Any]:
        _check(inputs, scalars)
        body: dict[str, Any] = {}
        for part, (items, sited) in parts.items():
            out = body[part] = list(items)
            for i, site in sited:
                out[i] = _fill(items[i], site, inputs, scalars)
        return body

    return make


class Filled:
    """Note [bodies made when read]: the graph body ``make(inputs, scalars)`` stands for
    (a template's ``instantiator``), plus ``extra`` top-level keys, made the first time
    it is read (``made``). A replay goes on the wire by fingerprint, inputs and scalars,
    and the journal keeps what it learns of a template by fingerprint (Note [journal
    facts of a template]): in the steady state nothing reads the body, and filling it
    took about a tenth of a replayed SGD step's client CPU (109 µs for a 253-node
    template with 54 inputs, on a 2-core host). It is made where a body is still read:
    a graph the appliance does not keep yet (sent whole), a resend after a recovery,
    the first facts of its template, and the journal's walks (a replay, a pruning)."""

    __slots__ = ("_body", "_make", "extra", "inputs", "keep", "nodes", "scalars")

    def __init__(
        self, make: Callable[[Any, Any], dict[str, Any]], inputs: list[str], scalars: list,
        counts: tuple[int, int], extra: dict[str, Any],
    ) -> None:  # fmt: skip
        self._make, self.inputs, self.scalars, self.extra = make, inputs, scalars, extra
        self.nodes, self.keep = counts  # the template's nodes and kept values
        self._body: dict[str, Any] | None = None

    def made(self) -> dict[str, Any]:
        body = self._body
        if body is None:
            body = self._body = {**self._make(self.inputs, self.scalars), **self.extra}
        return body


def filled(tpl: dict[str, Any], make: Callable, inputs: list[str], scalars: list) -> Filled:
    """The body of ``tpl`` (``make``: its instantiator) for ``inputs`` and ``scalars``, not
    made yet."""
    return Filled(make, inputs, scalars, (len(tpl["nodes"]), len(tpl["keep"])), {})


def made(body: Any) -> Any:
    """``body``, made if it is a ``Filled``."""
    return body.made() if type(body) is Filled else body


def count(body: Any, part: str) -> int:
    """How many ``part`` ("nodes", "keep") ``body`` holds, made or not."""
    return getattr(body, part) if type(body) is Filled else len(body.get(part, ()))


def flag(body: Any, key: str) -> Any:
    """A top-level value of ``body`` other than its parts (``partial``, ``unwaited``)."""
    return body.extra.get(key) if type(body) is Filled else body.get(key)


def _sites(x: Any) -> Any:
    """Where ``x`` holds slots: None (nowhere), ``("$in", k)`` or ``("$s", k)`` (it is
    one), or ``(None, [(key, sites), ...])`` for the items of a list or dict that do."""
    kind = type(x)
    if kind is dict:
        if len(x) == 1 and ("$in" in x or "$s" in x):
            ((tag, k),) = x.items()
            return (tag, k)
        items = [(k, site) for k, v in x.items() if (site := _sites(v)) is not None]
    elif kind is list:
        items = [(i, site) for i, v in enumerate(x) if (site := _sites(v)) is not None]
    else:
        return None
    return (None, items) if items else None


def _fill(x: Any, site: tuple, inputs: list, scalars: list) -> Any:
    tag, where = site
    if tag == "$in":
        return {"$h": _slot(inputs, where, "input")}
    if tag == "$s":
        return _slot(scalars, where, "scalar")
    out = list(x) if type(x) is list else dict(x)
    for key, inner in where:
        out[key] = _fill(x[key], inner, inputs, scalars)
    return out


def _check(inputs: Any, scalars: Any) -> None:
    if not isinstance(inputs, list) or not all(isinstance(h, str) for h in inputs):
        raise InvalidArgument("inputs must be a list of handles")
    if not isinstance(scalars, list) or not all(type(v) is float for v in scalars):
        raise InvalidArgument("scalars must be a list of floats")


def _filler(inputs: Any, scalars: Any) -> Callable[[Any], Any]:
    _check(inputs, scalars)

    def walk(x: Any) -> Any:
        kind = type(x)
        if kind is list:
            return [walk(v) for v in x]
        if kind is dict:
            if len(x) == 1 and "$in" in x:
                return {"$h": _slot(inputs, x["$in"], "input")}
            if len(x) == 1 and "$s" in x:
                return _slot(scalars, x["$s"], "scalar")
            return {k: walk(v) for k, v in x.items()}
        return x

    return walk


def _slot(values: list, k: Any, what: str) -> Any:
    if type(k) is not int or not 0 <= k < len(values):
        raise InvalidArgument(f"the graph names {what} {k!r}; {len(values)} were sent")
    return values[k]
