"""Graphs sent without waiting for their reply (Note [asynchronous flushes]): a mixin of
``Session`` (session.py), whose requests read such a graph's reply first, and then the
replies of the puts sent after it (puts.py, Note [puts sent without waiting]).

Note [replays sent ahead]: a replayed call (Note [asynchronous replays]) used to read the
last graph's reply before it sent its own, so the worker sat idle from the end of one
training step's graph until the client had read its reply, landed it and sent the next
(on a 2-core host, about 2-3 ms of a 15-18 ms replayed step). With the ``replay_ahead``
setting a replay goes while the graph before it still runs, and the worker, which runs
a session's requests in order, starts it as soon as that one ends. At most two graphs
are in flight: sending a third lands the first. The rules:

- it goes behind a graph that fails as a whole only (a replay, ``partial=False``): the
  rest of a partial graph that failed is sent again after it, and would then run after
  the replay that reads what it writes;
- the worker runs it only if that graph ran: the EXEC carries ``"after": rid`` and the
  worker answers BEHIND_FAILED, running nothing, if request ``rid`` failed. The client
  then sends it again if the first one's resend ran (its template had been let go), or
  fails it with an error naming the first one's. The program is told once, where the
  first lands (a call later than before, as CUDA reports a kernel's error at a later
  call); what the replay behind it made and wrote holds the error, and its landing is
  quiet;
- it goes behind the graph that was in flight when it read its inputs. If another thread
  landed that one meanwhile (a followed replay follows its steps first) and it failed,
  there is no request left for ``after`` to name: the client fails it in the same way,
  unsent;
- replies are read in the order sent, and a landing takes everything from the slots
  first, putting back what stays in flight: a recovery's journal replay (its requests
  settle first) must not land the graph behind before the one it rebuilds for, which is
  sent again first (``_land_pending``). A graph whose connection a recovery replaced is
  sent again, renamed for the new worker, after the one before it;
- a replay whose inputs the graph in flight makes lands it first (``replay_run._input``),
  and reads its inputs' handles as it is sent (``replay_outputs.replay_sent``): a followed
  replay (the default Adam's, Note [followed steps]) follows its steps while the last
  call's graph runs, and a landing meanwhile may rebuild the session;
- the worker remembers a session's last 16 failed EXECs, however they were answered (the
  admission queue answers one refused at its deadline itself).

``auto`` sends ahead where the worker has cores the client does not need: a GPU worker,
or a CPU worker with fewer threads than this host has cores. On a 2-core host whose
worker takes both, the client's work for the next step then takes a core from the graph
that runs, and ``python benchmarks/replay_ahead.py`` measured no steady gain (its
docstring has the numbers: with one worker thread, a replayed capturable-Adam step took
14.4 ms ahead against 18.0 after, and SGD 13.0 against 13.6 with local eager at 11.2)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from djinn.errors import BehindFailed, DjinnError, NotFound, WorkerLost, copy_of, error_from_wire
from djinn.protocol import templates
from djinn.protocol.frames import Kind
from djinn.protocol.tensors import to_wire

from .graph_forms import Form, form_of

if TYPE_CHECKING:
    from .session import Session


def _template_gone(exc: NotFound) -> bool:
    return "graph template" in exc.message


def _not_run(before: DjinnError) -> DjinnError:
    """The error of a graph sent behind one that failed (Note [replays sent ahead])."""
    message = f"not run: the graph sent before it failed ({before.code}: {before.message})"
    return error_from_wire(before.code, message)


def _cost(out: dict[str, Any], elapsed: float) -> float:
    """Note [a flight's cost]: what a graph sent without waiting costs the journal (the
    replay it would take after a worker loss, Note [lineage truncation]): how long the
    worker says it ran. From its sending to the reading of its reply, the client's own
    work counts too: a replay is read at the program's next call, a whole loop iteration
    later, and a journal that counted that cut itself, reading back every live value,
    several times as often (a review saw one inside a test's single call)."""
    took = out.get("took_s")
    if isinstance(took, (int, float)) and not isinstance(took, bool) and 0 <= took <= elapsed:
        return float(took)
    return elapsed


class Flights:
    """``Session``'s part that sends a graph and goes on; the attributes it uses
    (``_flight``, ``_flight_lock``, ``_lineage``, ``channel``...) are the session's."""

    def run_graph_async(
        self,
        nodes: Any,
        keep: Sequence,
        inline: Sequence,
        *,
        partial: bool = True,
        form: Form | None = None,
        filled: templates.Filled | None = None,
        ahead: Flight | None = None,
    ) -> Flight:
        """Send a graph that fetches nothing and go on: ``Flight.outcome()`` gives what
        ``run_graph`` would have (``partial=False``: what ``execute`` would, a failing
        node failing the request). The next request of the session reads its reply
        first; a worker lost meanwhile is recovered from then, as for any request.
        ``form``: the graph's template form, when the caller knows it (a replay);
        ``filled``: its body, not made yet (Note [bodies made when read]), for ``nodes``
        and ``keep``. ``ahead``: the graph in flight when the caller read its inputs;
        this one is sent while that one still runs, if it fails as a whole, and is not
        sent at all if that one landed meanwhile and failed (Note [replays sent
        ahead])."""
        segments = [memoryview(to_wire(t.detach().cpu())[1].numpy()) for t in inline]
        extra: dict[str, Any] = {"fetch": []}
        if partial:
            extra["partial"] = True
        # "unwaited": Note [a capturing client beside its worker] (appliance/executor)
        extra["unwaited"] = True
        body: Any
        if filled is not None:
            filled.extra = extra
            body = filled
        else:
            body = {"nodes": nodes, "keep": list(keep), **extra}
        f = Flight(self, body, segments, partial)
        f.form = form if form is not None else form_of(templates.made(body))
        with self._serial():
            # under the lock that sends: settled outside it, another thread's graph could
            # be sent in between and lost from ``_flight`` when this one took the slot (a
            # review's two threads replaying: that graph never landed)
            # the generation the body was built in; a journal cut that is due lands what
            # is in flight first (landed later, a recovery it made would leave this
            # graph's generation and its "after" stale: a review)
            lineage = self._lineage
            gen = lineage.before_request() if lineage is not None else 0
            if ahead is not None:
                self._land_pending(keep_last=True)  # at most two graphs in flight
            last = self._flight
            ok = ahead is not None and ahead.error is None
            if ok and last is not None and self._goes_behind(last):
                self._older.append((last, self._puts))
                self._flight, self._puts = None, []
                f.behind = last
            else:
                self._settle()
            if ahead is not None and ahead.error is not None:
                # it landed meanwhile (another thread read its reply) and failed: no
                # "after" can say so now, and this one would run on what it half wrote
                # (a review named the window: a loss came back as a number)
                f.error, f.chained, f.landed = _not_run(ahead.error), True, True
                return f
            if lineage is not None:
                f.gen = lineage.generation
                if f.gen != gen:
                    # what landed above rebuilt the session: the body names the lost
                    # worker's handles (a replay sent ahead of a graph that failed to go)
                    body = f.body = lineage.renamed(templates.made(body), gen)[0]
                    f.form = form_of(body)
            sent, f.fp = self._exec_form(body, f.form)
            f.sent = self._outgoing(sent)
            if f.behind is not None:
                f.sent["after"] = f.behind.rid  # the worker runs it only if that one ran
            f.started = time.perf_counter()
            f.channel = self.channel
            try:
                f.rid = self.channel.send(Kind.EXEC, f.sent, segments, sink=self._sink)
            except DjinnError as exc:
                f.error = copy_of(exc)  # _settle deals with it as with a failed reply
            self._flight = f
        return f

    def _serial(self) -> Any:
        """The lock under which a graph in flight is sent and settled. Taken after the
        journal's (whose cuts and recoveries make requests), never before it."""
        if self._lineage is None:
            return self._flight_lock
        both = contextlib.ExitStack()
        both.enter_context(self._lineage.lock)
        both.enter_context(self._flight_lock)
        return both

    def _settle(self) -> None:
        """Read the replies of what was sent without waiting, if anything (Note
        [asynchronous flushes], Note [puts sent without waiting]): the graph in flight
        and the puts sent after it, in that order, before the session's next request is
        sent or recorded."""
        if self._flight is None and not self._puts and not self._older:
            return
        with self._serial():
            self._land_pending()

    def _settle_through(self, f: Flight) -> None:
        """Read the replies of what was sent without waiting up to ``f``'s, in order: a
        graph sent behind ``f`` stays in flight."""
        with self._serial():
            self._land_pending(upto=f)

    def _land_pending(self, upto: Flight | None = None, keep_last: bool = False) -> None:
        """Land what was sent without waiting, in the order sent: everything, or up to
        ``upto``, or all but the graph in flight and the puts after it. All of it is
        taken from the slots first and what stays is put back: a request made while one
        lands (a recovery's journal replay, a graph sent again) settles first, and must
        find nothing to read before its own reply. A graph sent after the one landing
        must not land before it (sent again first after a recovery, it would run first)."""
        pending = [*self._older, (self._flight, self._puts)]
        self._older, self._flight, self._puts = [], None, []
        try:
            while pending and not (upto is not None and upto.landed):
                if keep_last and len(pending) == 1:
                    break
                f, puts = pending[0]
                # one at a time, each taken once it landed: an interrupted landing
                # (Note [interrupted waits], channel.py) leaves the rest in their slots
                if f is not None and not f.landed:
                    self._land(f)
                while puts:
                    self._land_put(puts[0])
                    puts.pop(0)
                pending.pop(0)
        finally:
            if pending:  # nothing is sent under this lock meanwhile: the slots are empty
                *older, (self._flight, self._puts) = pending
                self._older = older

    def _goes_behind(self, last: Flight) -> bool:
        """Whether a graph may be sent behind ``last``, the graph in flight: one that fails
        as a whole (a partial graph's rest is sent again after it failed: it would run
        after the graph behind it), that went out, on this connection (one that a
        recovery replaced is sent again after this one would have run)."""
        return not last.partial and last.error is None and last.channel is self.channel

    def _land(self, f: Flight) -> None:
        """Read ``f``'s reply and keep its result or error. Interrupted (a KeyboardInterrupt),
        it stays in flight: its reply is kept on it if it was read, or the connection
        closed, and a later landing sends it again (Note [interrupted waits], channel.py)."""
        body = f.body
        try:
            try:
                out = self._flight_reply(f)
            except BehindFailed as exc:
                behind = f.behind
                if behind is None or behind.error is None:
                    # the one before failed on its first try, and its resend ran
                    out, body = self._flight_again(f, exc)
                else:
                    f.chained = True  # its program was told already: Note [replays sent ahead]
                    raise _not_run(behind.error) from None
            except DjinnError as exc:
                out, body = self._flight_again(f, exc)
            seconds = _cost(out, time.perf_counter() - f.started)
            form = f.form if body is f.body else None  # not the journal's rewrite
            f.result = self._finish_exec(body, f.segments, out, seconds, form)
        except DjinnError as exc:
            f.error = copy_of(exc)  # raised where the program waits (Note [raising a kept error])
        f.behind = f.frame = None  # landed first: no chain of flights kept alive
        f.landed = True

    def _flight_reply(self, f: Flight) -> dict[str, Any]:
        if f.error is not None:  # it could not even be sent
            error, f.error = f.error, None
            self._not_done(error, f.sent)
            raise error
        if f.channel is not self.channel:
            # sent behind a graph whose worker was lost: the recovery the other's landing
            # made replaced the connection, and this one is sent again like it
            error = WorkerLost(
                f"the appliance worker serving session {self.id} went away; the request "
                "did not complete"
            )
            self._not_done(error, f.sent)
            raise error
        try:  # read once: a landing interrupted after it reads it again from here
            if f.frame is None:
                f.frame = self.channel.receive(f.rid)
            frame = f.frame
        except DjinnError as exc:
            self._not_done(exc, f.sent)
            raise
        self._done(f.sent)
        out = self._unpack(frame)
        self._kept_graph(f.sent, f.fp, out)
        return out

    def _flight_again(self, f: Flight, exc: DjinnError) -> tuple[dict[str, Any], Any]:
        """Send a graph in flight again, waiting this time: its template was let go, or
        its worker was lost (the session is rebuilt first, as ``run_body`` does)."""
        f.body = templates.made(f.body)
        attempt = lambda b: self._exec_body(b, f.segments)  # noqa: E731
        gone = isinstance(exc, NotFound) and _template_gone(exc)
        if gone or isinstance(exc, BehindFailed):
            if gone:
                self._graphs.discard(f.fp)
            if self._lineage is None:
                return attempt(f.body), f.body
            return self._lineage.run_body(attempt, f.body)
        if self._lineage is None:
            raise exc
        return self._lineage.resend(exc, f.gen, attempt, f.body)


REPLY_BYTES = 160  # a handle's share of a reply (a PUT's name or leased slab; a kept entry)


class Flight:
    """A graph sent without waiting for its reply (Note [asynchronous flushes])."""

    __slots__ = ("behind", "body", "chained", "channel", "error", "form", "fp", "frame", "gen",
                 "landed", "partial", "reply_bytes", "result", "rid", "segments", "sent",
                 "session", "started")  # fmt: skip

    def __init__(self, session: Session, body: Any, segments: list, partial: bool) -> None:
        self.session = session
        self.body, self.segments = body, segments
        self.sent: dict[str, Any] = body
        self.fp: str | None = None
        self.form: Form | None = None  # graph_forms.form_of
        self.gen = 0
        self.rid = 0
        self.started = 0.0
        self.landed = False
        self.partial = partial  # a failing node ends the run, not the request
        self.channel: Any = None  # the connection it went on
        self.behind: Flight | None = None  # the graph it was sent behind, until it lands
        self.chained = False  # failed because that one did
        self.frame: Any = None  # its reply, once read (Note [interrupted waits])
        self.result: tuple[list[Any], list[Any], dict[str, Any] | None] | None = None
        self.error: DjinnError | None = None
        # its reply's size, at most (Note [puts sent without waiting])
        self.reply_bytes = 1024 + REPLY_BYTES * templates.count(body, "keep")

    def outcome(self) -> tuple[list[Any], list[Any], dict[str, Any] | None]:
        """(kept, fetched, failure), as ``Session.run_graph``; its error if it failed."""
        if not self.landed:
            # under the lock a settle reads under: another thread (a request of its own, a
            # heartbeat) may have taken this graph from the slot and be reading its reply,
            # and ``_settle`` finds the slot empty (a review's two replaying threads saw
            # this graph unsettled)
            with self.session._serial():
                if not self.landed:
                    self.session._settle_through(self)
        if self.error is not None:
            raise copy_of(self.error)
        assert self.result is not None
        return self.result
