"""Which graphs go by template, and the template form a graph is sent in (Note [graph
templates], djinn/protocol/templates.py): a ``Session`` part."""

from __future__ import annotations

from typing import Any

from djinn.protocol import templates

Form = tuple[str, list[str], list[float]]  # a template's fingerprint, inputs and scalars

# Graphs this big or bigger go by template once the appliance keeps them (Note [graph
# templates]); smaller ones cost less to send whole than to template. A node weighs one,
# plus the length of each list it takes: an optimizer step is a few ``_foreach_`` nodes
# over every parameter (Adam: 7 nodes of 26-tensor lists for a small encoder), which went
# whole and interpreted at every step, where by template the worker compiles it.
TEMPLATE_MIN_WEIGHT = 16


def worth_a_template(nodes: Any) -> bool:
    """Whether a graph weighs TEMPLATE_MIN_WEIGHT, counted without walking its values. A
    node without arguments, or not a node at all, weighs one: the appliance says what is
    wrong with it (a caller of ``execute`` may send anything)."""
    if not isinstance(nodes, list):
        return False
    weight = len(nodes)
    for n in nodes:
        if weight >= TEMPLATE_MIN_WEIGHT:
            break
        args = n.get("args") if isinstance(n, dict) else None
        if type(args) is list:
            weight += sum(len(a) for a in args if type(a) is list)
    return weight >= TEMPLATE_MIN_WEIGHT


def form_of(body: dict[str, Any]) -> Form | None:
    """(fingerprint, inputs, scalars) of ``body``'s template, when it is big enough to
    go by one (``worth_a_template``). Known before the graph is sent, it also spares
    the journal a walk of every node once the appliance has answered (Note [journal
    facts of a template]), where it walked every graph no caller gave a form for."""
    if not worth_a_template(body["nodes"]):
        return None
    tpl, inputs, scalars = templates.template(body)
    return templates.fingerprint(tpl), inputs, scalars


class GraphForms:
    """``Session``'s part that chooses how a graph goes on the wire; ``_graphs`` (the
    fingerprints the appliance keeps for this session) is the session's."""

    _graphs: set[str]

    def _exec_form(self, body: Any, form: tuple | None = None) -> tuple[dict[str, Any], str | None]:
        """What goes on the wire for ``body`` (made or not: Note [bodies made when read]),
        and its template's fingerprint: the short form when the appliance keeps the
        template, else the whole graph. ``form``: the fingerprint, inputs and scalars of
        ``body``, already known."""
        if form is None:
            body = templates.made(body)
            form = form_of(body)
            if form is None:
                return body, None
        fp, inputs, scalars = form
        if fp not in self._graphs:
            return {**templates.made(body), "cache": True}, fp
        short = {"graph": fp, "inputs": inputs, "scalars": scalars}
        for flag in ("partial", "unwaited"):
            if templates.flag(body, flag):
                short[flag] = True
        return short, fp

    def _kept_graph(self, sent: dict[str, Any], fp: str | None, out: dict[str, Any]) -> None:
        if fp is not None and sent.get("cache") and out.get("graph") == fp:
            self._graphs.add(fp)
