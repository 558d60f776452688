"""Requests sent without waiting for their reply: graphs (Note [asynchronous flushes]) and
puts (Note [puts sent without waiting]). A mixin of ``Session`` (session.py), whose
requests read those replies first."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from djinn.errors import DjinnError, NotFound
from djinn.protocol.frames import Kind
from djinn.protocol.tensors import to_wire

from .graph_forms import Form, form_of
from .remote import RemoteTensor

if TYPE_CHECKING:
    import torch

    from .session import Session


def _template_gone(exc: NotFound) -> bool:
    return "graph template" in exc.message


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
    ) -> Flight:
        """Send a graph that fetches nothing and go on: ``Flight.outcome()`` gives what
        ``run_graph`` would have (``partial=False``: what ``execute`` would, a failing
        node failing the request). The next request of the session reads its reply
        first; a worker lost meanwhile is recovered from then, as for any request.
        ``form``: the graph's template form, when the caller knows it (a replay)."""
        segments = [memoryview(to_wire(t.detach().cpu())[1].numpy()) for t in inline]
        body: dict[str, Any] = {"nodes": nodes, "keep": list(keep), "fetch": []}
        if partial:
            body["partial"] = True
        # "unwaited": Note [a capturing client beside its worker] (appliance/executor)
        body["unwaited"] = True
        f = Flight(self, body, segments)
        f.form = form if form is not None else form_of(body)
        with self._serial():
            # under the lock that sends: settled outside it, another thread's graph could
            # be sent in between and lost from ``_flight`` when this one took the slot (a
            # review's two threads replaying: that graph never landed)
            self._settle()
            if self._lineage is not None:
                f.gen = self._lineage.before_request()
            sent, f.fp = self._exec_form(body, f.form)
            f.sent = self._outgoing(sent)
            f.started = time.perf_counter()
            try:
                f.rid = self.channel.send(Kind.EXEC, f.sent, segments, sink=self._sink)
            except DjinnError as exc:
                f.error = exc  # _settle deals with it as with a failed reply
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
        if self._flight is None and not self._puts:
            return
        with self._serial():
            # both taken first: a graph's resend (below) settles again, and must not read
            # puts from a connection its recovery has replaced
            f, self._flight = self._flight, None
            puts, self._puts = self._puts, []
            if f is not None:
                self._land(f)
            for p in puts:
                self._land_put(p)

    def _land(self, f: Flight) -> None:
        body = f.body
        try:
            try:
                out = self._flight_reply(f)
            except DjinnError as exc:
                out, body = self._flight_again(f, exc)
            seconds = _cost(out, time.perf_counter() - f.started)
            form = f.form if body is f.body else None  # not the journal's rewrite
            f.result = self._finish_exec(body, f.segments, out, seconds, form)
        except DjinnError as exc:
            f.error = exc  # raised where the program waits for this graph
        finally:
            f.landed = True

    # -- puts --------------------------------------------------------------------------
    def _send_put(
        self, tensors: list[torch.Tensor], body: dict[str, Any], segments: list
    ) -> list[RemoteTensor]:
        """Send a PUT whose handles the client named, and go on (Note [puts sent without
        waiting]); its reply is read by the session's next request."""
        frame = FRAME_BYTES * len(body["tensors"]) + sum(memoryview(g).nbytes for g in segments)
        with self._serial():
            unread_frames = sum(p.frame for p in self._puts)
            replies = (self._flight.reply_bytes if self._flight is not None else 0) + sum(
                p.reply_bytes for p in self._puts
            )
            if unread_frames + frame > UNREAD_MAX and replies > UNREAD_MAX:
                self._settle()  # both could fill the socket's buffers: read first
            p = PutFlight(self.channel, body.get("lease", ()), frame, len(body["tensors"]))
            try:
                p.rid = self.channel.send(Kind.PUT, body, segments)
            except DjinnError:
                # the worker is gone: what is in flight lands first (a graph is sent
                # again on the rebuilt session), before the journal's recovery that this
                # error starts (Lineage.run) replays into a new one
                self._settle()
                raise
            self._last_call = time.monotonic()  # a request renews the lease
            p.remotes = [RemoteTensor(self, e["name"], e["desc"]) for e in body["tensors"]]
            self._puts.append(p)
            if self._lineage is not None:  # before any other thread can recover the session
                self._lineage.record_put(tensors, p.remotes)
            return p.remotes

    def _land_put(self, p: PutFlight) -> None:
        if p.channel is not self.channel:
            return  # rebuilt since it was sent: the journal's replay put it again
        try:
            reply = self.channel.receive(p.rid).body
        except DjinnError as exc:
            self._put_failed(p, exc)
            return
        self._spares.add(reply.get("leased", ()), p.lease)

    def _put_failed(self, p: PutFlight, exc: DjinnError) -> None:
        """A put's tensors hold its error from now on; reading one raises it. A lost
        worker in a recovering session is not a failed put: the next request rebuilds
        the session, and the journal's replay puts them again."""
        self._not_done(exc, {})
        if self._lineage is not None and exc.code in self._lineage.policy.errors:
            return
        for r in p.remotes:
            r.failed = exc
            r._finalizer.detach()  # nothing on the appliance to free
        if self._lineage is not None:  # nor to put again after a recovery
            self._lineage.record_frees([r.handle for r in p.remotes], None)

    def _flight_reply(self, f: Flight) -> dict[str, Any]:
        if f.error is not None:  # it could not even be sent
            error, f.error = f.error, None
            self._not_done(error, f.sent)
            raise error
        try:
            frame = self.channel.receive(f.rid)
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
        attempt = lambda b: self._exec_body(b, f.segments)  # noqa: E731
        if isinstance(exc, NotFound) and _template_gone(exc):
            self._graphs.discard(f.fp)
            if self._lineage is None:
                return attempt(f.body), f.body
            return self._lineage.run_body(attempt, f.body)
        if self._lineage is None:
            raise exc
        return self._lineage.resend(exc, f.gen, attempt, f.body)


# Note [puts sent without waiting]: a put the program does not wait for
# (``Session.put(t, wait=False)``; the frontend's ``x.to(remote)``, but for a small tensor
# moved in while its thread captures a graph, which goes inside it) returns once its bytes
# have left ``t``: copied into an arena slab, or written to the socket inside the frame.
# Its handles must be known then, so the client names them (128 random bits each,
# ``secrets.token_urlsafe(16)``); the worker checks each name (well formed, new to the
# session) and keeps it in the session's own table, so no name reaches another
# session's tensor. The reply is read by the session's next request (``_settle``, after
# the graph in flight), so a put goes out behind a replay still running: a training loop
# that moves its batch in with ``.to(remote)`` no longer waits for the last step to end
# before it makes the next step's replay.
# - A PUT that fails keeps nothing, and the worker remembers why under its names (the
#   last 256): a graph or GET sent before the client read the failure fails with that
#   error's type ("handle ...: its PUT failed: ..."). Once it is read, the put's tensors
#   hold the error (``RemoteTensor.failed``), raised where they are read, as a failed
#   op's are (Note [failed values]). A lost worker is not a failed put in a recovering
#   session: the journal recorded the put as it was sent, and the rebuild puts it again.
# - The worker stops reading a session whose reply it cannot write (Note [slow readers]
#   in appliance/outbox.py); a client blocked sending to it meanwhile would wait for
#   ever. So the replies are read first when both what was sent and what is to be read
#   could fill the connection's buffers: unread put frames and unread replies (at most
#   their estimate) both over UNREAD_MAX.
# - Waited for still: ``Session.put`` by default (its error where the program put), ALLOC,
#   and the puts of a recovery's replay and of a warm standby.
UNREAD_MAX = 64 << 10
FRAME_BYTES = 256  # a PUT entry's share of its frame, beside its inline bytes
REPLY_BYTES = 160  # a handle's share of a reply (a PUT's name or leased slab; a kept entry)
AHEAD_MAX = 64  # handles a GET may name and still be sent before unread puts' replies


class PutFlight:
    """A PUT sent without waiting for its reply (Note [puts sent without waiting])."""

    __slots__ = ("channel", "frame", "lease", "remotes", "reply_bytes", "rid")

    def __init__(self, channel: Any, lease: Sequence[int], frame: int, tensors: int) -> None:
        self.channel = channel  # the connection it went on: a rebuilt session has another
        self.lease = list(lease)
        self.frame = frame
        self.rid = 0
        self.remotes: list[RemoteTensor] = []
        # its reply, at most: a name per tensor and a slab per lease (a review's
        # put_many of 4096 tensors, estimated at 1 KiB, filled the buffers: 30 s stalls)
        self.reply_bytes = 1024 + REPLY_BYTES * (tensors + len(self.lease))

    def __repr__(self) -> str:
        return f"PutFlight(rid={self.rid}, tensors={len(self.remotes)})"


class Flight:
    """A graph sent without waiting for its reply (Note [asynchronous flushes])."""

    __slots__ = ("body", "error", "form", "fp", "gen", "landed", "reply_bytes", "result", "rid",
                 "segments", "sent", "session", "started")  # fmt: skip

    def __init__(self, session: Session, body: dict[str, Any], segments: list) -> None:
        self.session = session
        self.body, self.segments = body, segments
        self.sent: dict[str, Any] = body
        self.fp: str | None = None
        self.form: Form | None = None  # graph_forms.form_of
        self.gen = 0
        self.rid = 0
        self.started = 0.0
        self.landed = False
        self.result: tuple[list[Any], list[Any], dict[str, Any] | None] | None = None
        self.error: DjinnError | None = None
        # its reply's size, at most (Note [puts sent without waiting])
        self.reply_bytes = 1024 + REPLY_BYTES * len(body.get("keep", ()))

    def outcome(self) -> tuple[list[Any], list[Any], dict[str, Any] | None]:
        """(kept, fetched, failure), as ``Session.run_graph``; its error if it failed."""
        if not self.landed:
            # under the lock a settle reads under: another thread (a request of its own, a
            # heartbeat) may have taken this graph from the slot and be reading its reply,
            # and ``_settle`` finds the slot empty (a review's two replaying threads saw
            # this graph unsettled)
            with self.session._serial():
                if not self.landed:
                    self.session._settle()
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result
