"""Flushes in flight: graphs sent without waiting for their replies (Note [asynchronous
flushes]), a replayed graph sent so (``replay_in_flight``), and how they land.

Below ``trace`` in the import order (trace.py imports this module): ``trace._after_failure``,
which a landing graph's partial failure runs, is given by ``attach`` once trace.py defined
it, as ``immediate`` is given the LazyTensor class.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from djinn.errors import DjinnError, copy_of
from djinn.protocol.templates import Filled

from . import interrupts
from .failures import fail, raise_on_owner
from .nodes import Node, ran

if TYPE_CHECKING:
    from .trace import Trace

_after_failure: Any = None  # trace._after_failure, given by ``attach``


def attach(after_failure: Any) -> None:
    """Take ``trace._after_failure`` (trace.py, once it defined it)."""
    global _after_failure
    _after_failure = after_failure


# -- Note [asynchronous flushes] ------------------------------------------------------------
# A flush nobody waits on (one thread reading what another captured: the backward pass
# reading the forward, the optimizer reading the gradients at the end of backward) sends
# its graph and returns: the thread captures its next ops while the appliance runs the
# graph, instead of the two taking turns (in a 20-step Adam loop the worker waited for
# the client 43% of the time, and the client for the worker the rest). The graph *lands*
# (its nodes become executed, its kept outputs handles, a partial failure is handled as
# a synchronous flush would) when a graph that reads it is encoded, or before any flush
# or request. Until then at most one EXEC is in flight per session: every other request
# of the session reads its reply first, so the appliance and the journal see the same
# order. Errors: a request that fails as a whole fails its nodes and is raised on the
# thread that owns the trace when it lands there (Note [failures raised on their thread],
# failures.py; by backward() for the graphs its pass sent); a failure at the end of
# backward stays quiet (the gradients hold it), but for a check's, which nothing holds.
_INFLIGHT: list[Sent] = []
_INFLIGHT_LOCK = threading.Lock()


class Sent:
    """A flush sent without waiting for its reply."""

    __slots__ = ("error", "flight", "inputs", "keep_targets", "landed", "lock", "quiet", "reply",
                 "sent", "trace")  # fmt: skip

    def __init__(self, trace: Trace, sent: list[Node], keep_targets: list, quiet: bool) -> None:
        self.trace, self.sent, self.keep_targets, self.quiet = trace, sent, keep_targets, quiet
        self.flight: Any = None
        self.landed = False  # its nodes are executed or failed (under the trace's lock)
        self.lock = threading.RLock()  # held while the reply is read
        self.reply: tuple[list[Any], list[Any], Any] | None = None  # (kept, fetched, failure)
        self.error: DjinnError | None = None  # or why the request failed as a whole
        self.inputs: list[Any] = []  # a replay's input values, held until it lands


@contextlib.contextmanager
def replay_in_flight(trace: Trace, node: Node, body: Filled, inline: list, form: Any,
                     inputs: list, *, ahead: Any = None) -> Iterator[None]:  # fmt: skip
    """Send ``body`` (not made: Note [bodies made when read], templates.py), a replayed
    graph whose kept outputs are ``node``'s (Note [asynchronous replays], replay_run.py),
    without waiting: it lands as a flush sent without waiting does, and fails as a whole
    (``fail``: its outputs and what it writes hold the error). The block binds the
    outputs: nothing lands the graph before it ends (the landing then points every output
    bound in it at its handle). ``inputs``, the RemoteTensors it reads, are held until it
    lands, as a captured graph's nodes hold theirs: a program that drops a batch it moved
    in (``x.to(remote)``) as the call returns must not free it from the journal a
    recovery replays before this graph is sent again (test_recovery's replayed loop, its
    batches put: the resent replay got NOT_FOUND). ``ahead``: the flight it goes behind
    (Note [replays sent ahead])."""
    from .session import default_session

    item = Sent(trace, [node], [(node, k, []) for k in range(node.nout)], quiet=False)
    item.inputs = inputs
    with interrupts.deferred(), item.lock:  # Note [interrupted waits]
        try:
            item.flight = default_session().run_graph_async(
                (), (), inline, partial=False, form=form, filled=body, ahead=ahead
            )
        except (DjinnError, KeyboardInterrupt) as exc:
            _not_run([node], exc)
            raise
        node.inflight = item
        with _INFLIGHT_LOCK:
            _INFLIGHT.append(item)
        yield
        for n, k, alive in item.keep_targets:
            alive.extend(cell for w in n.holders[k] if (cell := w()) is not None)


def land_all(but_last: bool = False) -> Any:
    """Land every flush in flight, in the order sent; ``but_last``: not the last if it
    fails as a whole, for a replay to go behind: its flight (Note [replays sent ahead])."""
    with _INFLIGHT_LOCK:
        items = list(_INFLIGHT)
    # a partial one's failure sends its rest again, which must run before the replay
    kept = but_last and items and getattr(items[-1].flight, "partial", True) is False
    last = items.pop().flight if kept else None
    for item in items:
        land(item)
    return last


def _not_run(sent: list[Node], exc: BaseException) -> None:
    """The request that sent ``sent`` failed, or a second Ctrl-C left its result unread."""
    why = interrupts.why(exc)
    for n in sent:
        fail(n, why)


def land(item: Sent) -> None:
    """Read ``item``'s reply and make its nodes executed (or failed), once; a first
    Ctrl-C meanwhile is raised after (Note [interrupted waits])."""
    with interrupts.deferred():
        _land(item)


def _land(item: Sent) -> None:
    """``land``'s work.

    Note [landing in two steps]: the nodes name ``item`` in ``inflight`` until they are
    executed, so a thread that reads one of their outputs meanwhile lands it too and
    finds them executed; they used to stop naming it before the reply was read, and a
    review found a reader on another thread taking such an output for one of another
    trace's. The reply is read under ``item.lock`` alone, and the nodes are changed under
    their trace's lock alone: a thread that encodes a graph holds its trace's lock while
    it lands what the graph reads, and one landing ``item`` must not then hold
    ``item.lock`` while it waits for that trace's lock (the two waited on each other)."""
    with item.lock:
        if item.reply is None and item.error is None:
            try:
                item.reply = item.flight.outcome()
            except DjinnError as exc:  # the request itself failed: nothing is known to run
                item.error = copy_of(exc)  # Note [raising a kept error]
    with item.trace.lock:
        if item.landed:
            return
        item.landed = True
        item.inputs = []
        with _INFLIGHT_LOCK:
            _INFLIGHT.remove(item)
        if item.error is not None:
            for n in item.sent:
                fail(n, item.error)
                n.inflight = None
            # not if it failed as the one before it did (Note [replays sent ahead])
            if not (item.quiet or getattr(item.flight, "chained", False)):
                raise_on_owner(item.trace, item.error, keep=False)
            return
        assert item.reply is not None
        kept, _fetched, failure = item.reply
        ran(item.sent, item.keep_targets, kept, failure)
        for n in item.sent:
            n.inflight = None
        if failure is None:
            return
        try:
            _after_failure(item.trace, item.sent, failure, [], [], [], [])
        except DjinnError as exc:  # a check's (an op that only raises): not quiet, as no
            # value holds it (a custom backward's singular inv: backward() and every read
            # after it went on without the error, a review)
            raise_on_owner(item.trace, exc, keep=True)
