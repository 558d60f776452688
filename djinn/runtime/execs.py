"""Execs: a session's op graphs run and waited for (EXEC: ``execute``, ``run_graph``),
sent by template once the appliance keeps one, and how a reply's tensors land
(``_unpack``, GET's replies too). A mixin of ``Session`` (session.py); the attributes it
uses (``channel``, ``arena``, ``_graphs``, ``_lineage``...) are the session's. Graphs sent
without waiting are ``Flights``' (flights.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from djinn.errors import InvalidArgument, NotFound
from djinn.protocol.frames import Frame, Kind
from djinn.protocol.tensors import from_wire, to_wire, validate

from . import lineage
from .flights import _template_gone
from .graph_forms import form_of
from .remote import RemoteTensor
from .slabs import copy_bytes

NOT_RUN = object()  # a fetched value whose node did not run (run_graph)


def _u8(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8, device="cpu")  # never the default device


class Execs:
    """``Session``'s part that runs a graph and waits for its reply; the attributes it
    uses (``channel``, ``arena``, ``_graphs``, ``_lineage``...) are the session's."""

    def execute(
        self,
        nodes: list[dict[str, Any]],
        *,
        keep: Sequence[dict[str, Any]] = (),
        fetch: Sequence[dict[str, Any]] = (),
        inline: Sequence[torch.Tensor] = (),
        form: tuple[str, list[str], list[float]] | None = None,
    ) -> tuple[list[RemoteTensor], list[Any]]:
        """Run an op graph (see ``djinn.protocol.graph``) on the session's worker.

        Returns (kept values as RemoteTensors, fetched values as tensors or numbers).
        ``inline`` tensors are referenced in the graph as ``{"$t": i, "desc": ...}`` (use
        :func:`inline_ref`). A failing node fails the whole request. ``form``: the graph's
        template fingerprint, inputs and scalars when the caller knows them (a replay,
        Note [replayable functions]), so they are not worked out again.
        """
        kept, fetched, _ = self._exec(nodes, keep, fetch, inline, partial=False, form=form)
        return kept, fetched

    def run_graph(
        self,
        nodes: list[dict[str, Any]],
        *,
        keep: Sequence[dict[str, Any]] = (),
        fetch: Sequence[dict[str, Any]] = (),
        inline: Sequence[torch.Tensor] = (),
        form: tuple[str, list[str], list[float]] | None = None,
    ) -> tuple[list[RemoteTensor | None], list[Any], dict[str, Any] | None]:
        """Like ``execute``, but a failing node does not fail the request (the appliance's
        Note [partial graphs]): returns (kept, fetched, failure). With a failure
        ``{"node", "code", "message"}``, the nodes from the failed one on did not run:
        their kept entries are None and their fetched entries ``NOT_RUN``. ``form``: as
        ``execute``'s."""
        return self._exec(nodes, keep, fetch, inline, partial=True, form=form)

    def _exec(
        self,
        nodes: Any,
        keep: Sequence,
        fetch: Sequence,
        inline: Sequence,
        *,
        partial: bool,
        form: tuple[str, list[str], list[float]] | None = None,
    ) -> tuple[list[Any], list[Any], dict[str, Any] | None]:
        segments = [memoryview(to_wire(t.detach().cpu())[1].numpy()) for t in inline]
        body = {"nodes": nodes, "keep": list(keep), "fetch": list(fetch)}
        if partial:
            body["partial"] = True
        if form is None:  # worked out once, for the wire and for the journal's facts
            form = form_of(body)
        if self._lineage is None:
            out = self._exec_body(body, segments, form)
        else:
            # a body the journal rewrote (handles of a rebuilt session) has another form
            attempt = lambda b: self._exec_body(b, segments, form if b is body else None)  # noqa: E731
            sent = body
            out, body = self._lineage.run_body(attempt, body)
            form = form if body is sent else None
        seconds = self._lineage.took() if self._lineage is not None else 0.0
        return self._finish_exec(body, segments, out, seconds, form)

    def _finish_exec(
        self,
        body: dict[str, Any],
        segments: list,
        out: dict[str, Any],
        seconds: float,
        form: tuple[str, list[str], list[float]] | None = None,
    ) -> tuple[list[Any], list[Any], dict[str, Any] | None]:
        """An EXEC's reply as (kept, fetched, failure), recorded in the journal; ``form``
        when the body's template is known (Note [journal facts of a template]).

        A failure's ``held`` values (the appliance's Note [values the rest reads]) come
        back as ``(reference, RemoteTensor)`` pairs, and the journal records them as if
        ``keep`` had named them: a replay of the graph then keeps them as such."""
        failure = out.get("failed")
        held = failure.get("held") if isinstance(failure, dict) else None
        if held:
            body = {**body, "keep": [*body.get("keep", []), *(h["ref"] for h in held)]}
            out = {**out, "kept": [*out["kept"], *held]}
            form = None  # another keep list: the template's facts do not apply
        kept = [None if k is None else RemoteTensor(self, k["handle"], k) for k in out["kept"]]
        if self._lineage is not None:
            entry = lineage.Lineage.graph_entry(body, segments, out)
            entry.seconds = seconds
            self._lineage.record_graph(entry, kept, form)
        if held:
            kept, bound = kept[: -len(held)], kept[-len(held) :]
            failure = {**failure, "held": [(h["ref"], r) for h, r in zip(held, bound, strict=True)]}
        tensors = iter(out["tensors"])
        fetched = [
            NOT_RUN if isinstance(v, dict) else next(tensors) if v is None else v
            for v in out["values"]
        ]
        return kept, fetched, failure

    def _exec_body(
        self, body: dict[str, Any], segments: list, form: tuple | None = None
    ) -> dict[str, Any]:
        """EXEC ``body``: a graph the appliance keeps goes by fingerprint (Note [graph
        templates] in djinn/protocol/templates.py), a new one whole, asking it to keep it."""
        sent, fp = self._exec_form(body, form)
        if "graph" in sent:
            try:
                return self._unpack(self._call(Kind.EXEC, sent, segments, sink=self._sink))
            except NotFound as exc:
                if not _template_gone(exc):
                    raise
                self._graphs.discard(fp)  # the appliance let it go: send it whole again
            sent = {**body, "cache": True}
        out = self._unpack(self._call(Kind.EXEC, sent, segments, sink=self._sink))
        self._kept_graph(sent, fp, out)
        return out

    def _unpack(self, frame: Frame, out: Sequence[torch.Tensor] | None = None) -> dict[str, Any]:
        """Turn a reply's tensor entries into local tensors: one copy out of the arena, or
        the tensor the payload was received into."""
        items = frame.body.get("tensors", [])
        if out is not None:
            self._check_out(items, out)
        tensors = []
        for i, item in enumerate(items):
            dest = out[i] if out is not None else None
            direct = _bytes_of(dest, item["desc"]) if dest is not None else None
            if "slab" in item:
                nbytes = _nbytes(item["desc"])
                raw = direct if direct is not None else _u8(nbytes)
                copy_bytes(raw, self._arena_tensor(item["slab"], nbytes))
                self._give_back([item["slab"]])
            else:
                seg = frame.segments[item["seg"]]
                raw = torch.frombuffer(seg, dtype=torch.uint8) if len(seg) else _u8(0)
            value = from_wire(item["desc"], raw)
            if dest is not None and direct is None:
                dest.copy_(value)  # layouts differ: one strided copy
            tensors.append(dest if dest is not None else value)
        return {**frame.body, "tensors": tensors}

    def _check_out(self, items: list[dict[str, Any]], out: Sequence[torch.Tensor]) -> None:
        """``out=`` was checked against the shapes the client knew; an op on the appliance
        may have grown the tensor since (``out=`` ops resize). Refused before any copy,
        with every reply slab given back: copying the bytes would overrun ``out``."""
        for item, dest in zip(items, out, strict=False):
            dtype, shape = validate(item["desc"])[:2]
            if dest.dtype != dtype or list(dest.shape) != list(shape):
                self._give_back(i["slab"] for i in items if "slab" in i)
                raise InvalidArgument(
                    f"out= is {list(dest.shape)} {dest.dtype}, but the remote tensor is now "
                    f"{list(shape)} {dtype}"
                )


def _bytes_of(t: torch.Tensor, desc: dict[str, Any]) -> torch.Tensor | None:
    """``t``'s bytes as a flat uint8 view if they can take the wire bytes as they are."""
    if not t.is_contiguous() or list(t.stride()) != list(desc["strides"]) or not t.numel():
        return None
    return t.reshape(-1).view(torch.uint8)


def _nbytes(desc: dict[str, Any]) -> int:
    return validate(desc)[3]
