"""The worker's graph templates: op graphs sessions send again and again, kept by
fingerprint (Note [graph templates] in djinn/protocol/templates.py).

A template is computed here, from a graph a session sent whole and asked to keep, never
taken from a client; so one session's template serves every session that sends the same
structure, each with its own handles and scalars. The store is a bounded LRU: at most
``MAX_TEMPLATES`` templates and ``MAX_NODES`` ops in all; a request naming one that was
let go gets NOT_FOUND ("graph template"), and its client sends the graph whole again.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from djinn.errors import InvalidArgument, NotFound
from djinn.protocol import templates

MAX_TEMPLATES = 256
MAX_NODES = 200_000


class GraphTemplates:
    def __init__(self, max_templates: int = MAX_TEMPLATES, max_nodes: int = MAX_NODES) -> None:
        self.max_templates = max_templates
        self.max_nodes = max_nodes
        self._kept: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._nodes = 0
        self.hits = 0
        self.kept = 0

    def template(self, fp: Any) -> dict[str, Any]:
        """The template a request names (NOT_FOUND when it was let go)."""
        tpl = self._kept.get(fp) if isinstance(fp, str) else None
        if tpl is None:
            raise NotFound(f"no graph template {str(fp)[:40]!r} on this worker: send it whole")
        self._kept.move_to_end(fp)
        self.hits += 1
        return tpl

    def expand(self, body: dict[str, Any], tpl: dict[str, Any] | None = None) -> dict[str, Any]:
        """The whole graph a ``{"graph": fp, "inputs", "scalars"}`` request stands for."""
        if tpl is None:
            tpl = self.template(body.get("graph"))
        whole = templates.instantiate(tpl, body.get("inputs"), body.get("scalars"))
        if body.get("partial") is True:
            whole["partial"] = True
        return whole

    def keep(self, body: dict[str, Any]) -> str:
        """Keep the template of a graph sent whole; its fingerprint, for the reply."""
        if not isinstance(body.get("nodes"), list):
            raise InvalidArgument("nodes must be a list")
        tpl, _inputs, _scalars = templates.template(body)
        fp = templates.fingerprint(tpl)
        if fp in self._kept:
            self._kept.move_to_end(fp)
            return fp
        size = len(tpl["nodes"])
        if size > self.max_nodes:
            return fp  # too big to keep: the client keeps sending it whole
        self._kept[fp] = tpl
        self._nodes += size
        self.kept += 1
        while len(self._kept) > self.max_templates or self._nodes > self.max_nodes:
            _, old = self._kept.popitem(last=False)
            self._nodes -= len(old["nodes"])
        return fp

    def size_of(self, fp: Any) -> int:
        """Ops in the template ``fp`` (0 if it is not kept): what the scheduler weighs."""
        tpl = self._kept.get(fp) if isinstance(fp, str) else None
        return len(tpl["nodes"]) if tpl is not None else 0

    def stats(self) -> dict[str, int]:
        return {"templates": len(self._kept), "nodes": self._nodes, "hits": self.hits}
