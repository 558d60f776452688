"""What a graph the appliance ran up to a failed node leaves on the client (the
appliance's Note [partial graphs]): the failed node and what depends on it fail, the
independent rest is sent again, and Note [values a failed graph dropped]."""

from __future__ import annotations

from typing import Any

from djinn.runtime.remote import RemoteTensor

from .failures import (
    Failed,
    checked_nodes,
    depends_on_failure,
    fail,
    failed_error,
    remote_failed,
)
from .nodes import Node, Pending


def settle(sent: list[Node], failure: dict[str, Any]) -> tuple[list[Node], Any]:
    """The appliance ran ``sent`` up to the failed node (its Note [partial graphs]): fail
    that node and what depends on it. Returns the independent rest, for the trace to send
    again (``trace._after_failure``), and the error to raise once it ran if the failed op's
    only effect was to raise (a check such as ``_linalg_check_errors``), as it would have
    in eager PyTorch; else None."""
    from djinn.errors import error_from_wire

    error = error_from_wire(str(failure.get("code")), str(failure.get("message")))
    error._djinn_failed_value = True  # type: ignore[attr-defined]
    error._djinn_origin = object()  # type: ignore[attr-defined]  # its copies', too: reported
    rest = sent[failure["node"] :]
    raise_now = error if rest[0].nout == 0 else None
    checked = checked_nodes(rest[0]) if raise_now is not None else ()
    fail(rest[0], error)
    # Note [values a failed graph dropped]: the run stopped at the failure, and what ran
    # before it that nothing held is gone. What a node still to run reads came back as a
    # handle (the appliance's Note [values the rest reads]; ``nodes.ran`` bound it), so
    # the rest computes, as in eager, where a `try` caught the error at once. A value
    # still missing here (a session over its quota got none) fails the nodes that read
    # it with an error that says so, naming the failure: they read INTERNAL "released
    # before it was read" before (a review). A failed check's op failed as a whole, as
    # in eager (`linalg.inv` raises, its result never made): its outputs hold the error.
    dropped = error_from_wire(
        str(failure.get("code")),
        f"it reads a value computed before a failed op in the same graph, dropped with the "
        f"graph's run: {error.message}",
    )
    dropped._djinn_failed_value = True  # type: ignore[attr-defined]
    for n in sent[: failure["node"]]:
        for i, value in enumerate(n.results or ()):
            if value is None:
                n.results[i] = Failed(dropped)
            elif n in checked:
                value.failed = value.failed or error
    again = []
    for n in rest[1:]:
        if depends_on_failure(n):
            fail(n, error if _reads_failed(n) else failed_error(n.name, dropped))
        else:
            again.append(n)
    return again, raise_now


def _reads_failed(node: Node) -> bool:
    """Whether ``node`` reads a value that failed, rather than only values a failed graph
    dropped (Note [values a failed graph dropped])."""
    for x in [*(node.args or ()), *(node.kwargs or {}).values()]:
        for v in x if type(x) in (list, tuple) else (x,):
            if isinstance(v, Pending) and v.node.failed is not None:
                return True
            if isinstance(v, Pending) and v.node.executed and v.node.results:
                v = v.node.results[v.index]
            if isinstance(v, RemoteTensor) and remote_failed(v) is not None:
                return True
    return False
