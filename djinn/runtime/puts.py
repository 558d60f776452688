"""Puts: a session's uploads, waited for or not (Note [puts sent without waiting]). A
mixin of ``Session`` (session.py); the attributes it uses (``channel``, ``_spares``,
``_puts``, ``_lineage``...) are the session's."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from djinn.errors import DjinnError, ResourceExhausted, error_from_wire
from djinn.protocol.frames import Kind
from djinn.protocol.tensors import to_wire

from .flights import REPLY_BYTES
from .remote import RemoteTensor
from .slabs import copy_bytes

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
AHEAD_MAX = 64  # handles a GET may name and still be sent before unread puts' replies


class PutFlight:
    """A PUT sent without waiting for its reply (Note [puts sent without waiting])."""

    __slots__ = ("channel", "frame", "lease", "remotes", "reply", "reply_bytes", "rid")

    def __init__(self, channel: Any, lease: Sequence[int], frame: int, tensors: int) -> None:
        self.channel = channel  # the connection it went on: a rebuilt session has another
        self.lease = list(lease)
        self.frame = frame
        self.rid = 0
        self.reply: dict[str, Any] | None = None  # once read (Note [interrupted waits])
        self.remotes: list[RemoteTensor] = []
        # its reply, at most: a name per tensor and a slab per lease (a review's
        # put_many of 4096 tensors, estimated at 1 KiB, filled the buffers: 30 s stalls)
        self.reply_bytes = 1024 + REPLY_BYTES * (tensors + len(self.lease))

    def __repr__(self) -> str:
        return f"PutFlight(rid={self.rid}, tensors={len(self.remotes)})"


class Puts:
    """``Session``'s uploads (Note [lease ahead] in slabs.py, Note [puts sent without waiting])."""

    def put(self, tensor: torch.Tensor, *, wait: bool = True) -> RemoteTensor:
        """Copy ``tensor`` to the appliance; returns its remote handle. ``wait=False``
        returns as soon as the bytes are copied out of ``tensor``, before the appliance
        has answered (Note [puts sent without waiting])."""
        return self.put_many([tensor], wait=wait)[0]

    def put_many(self, tensors: Iterable[torch.Tensor], *, wait: bool = True) -> list[RemoteTensor]:
        tensors = list(tensors)
        if not wait:  # recorded in the journal as it is sent
            return self._recovering(lambda _: self._put_many(tensors, wait=False))
        remotes = self._recovering(lambda _: self._put_many(tensors))
        if self._lineage is not None:
            self._lineage.record_put(tensors, remotes)
        return remotes

    def _put_many(self, tensors: list[torch.Tensor], wait: bool = True) -> list[RemoteTensor]:
        entries: list[dict[str, Any]] = []
        segments: list[Any] = []
        bulk: list[tuple[int, torch.Tensor]] = []
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"put() takes tensors, got {type(t).__name__}")
            desc, flat = to_wire(t.detach().cpu())
            # the client names every handle (Note [puts sent without waiting])
            entry: dict[str, Any] = {"desc": desc, "name": secrets.token_urlsafe(16)}
            if self.arena is not None and flat.numel() > self.inline_max:
                bulk.append((len(entries), flat))
            else:
                entry["seg"] = len(segments)
                segments.append(memoryview(flat.numpy()) if flat.numel() else b"")
            entries.append(entry)
        body: dict[str, Any] = {"tensors": entries}
        if bulk:
            sizes = [f.numel() for _, f in bulk]
            if self._puts and self._flight is None and not self._spares.covers(sizes):
                # the slabs leased ahead for these may come back in replies not read yet
                # (Note [puts sent without waiting]): reading them beats an ALLOC, and
                # nothing else is in the way (a graph still running would be)
                self._settle()
            slabs = self._spares.take(sizes)
            missing = [n for n, off in zip(sizes, slabs, strict=True) if off is None]
            if missing:
                try:
                    fresh = iter(self._alloc(missing))
                except DjinnError:
                    self._give_back(off for off in slabs if off is not None)  # spares taken
                    raise
                slabs = [next(fresh) if off is None else off for off in slabs]
            for (i, flat), off in zip(bulk, slabs, strict=True):
                copy_bytes(self._arena_tensor(off, flat.numel()), flat)
                entries[i]["slab"] = off
            lease, unused = self._spares.plan(sizes)
            if lease:
                body["lease"] = lease
            self._give_back(unused)
        if not wait:
            return self._send_put(tensors, body, segments)
        reply = self._call(Kind.PUT, body, segments).body
        self._spares.add(reply.get("leased", ()), body.get("lease", ()))
        handles = reply["handles"]
        return [RemoteTensor(self, h, e["desc"]) for h, e in zip(handles, entries, strict=True)]

    def _alloc(self, sizes: list[int]) -> list[int]:
        """New slabs; if the arena refuses while this session holds spare slabs, they are
        given back with a second try (Note [lease ahead])."""
        try:
            return self._call(Kind.ALLOC, {"sizes": sizes}).body["slabs"]
        except ResourceExhausted:
            spare = self._spares.drain()
            if not spare:
                raise
        self._give_back(spare)
        return self._call(Kind.ALLOC, {"sizes": sizes}).body["slabs"]

    # -- puts --------------------------------------------------------------------------
    def _send_put(
        self, tensors: list[torch.Tensor], body: dict[str, Any], segments: list
    ) -> list[RemoteTensor]:
        """Send a PUT whose handles the client named, and go on (Note [puts sent without
        waiting]); its reply is read by the session's next request."""
        frame = FRAME_BYTES * len(body["tensors"]) + sum(memoryview(g).nbytes for g in segments)
        with self._serial():
            unread = [p for _, puts in self._older for p in puts] + self._puts
            unread_frames = sum(p.frame for p in unread)
            flights = [f for f, _ in self._older] + [self._flight]
            replies = sum(f.reply_bytes for f in flights if f is not None) + sum(
                p.reply_bytes for p in unread
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
        try:  # read once: a landing interrupted after it reads it again from here
            if p.reply is None:
                p.reply = self.channel.receive(p.rid).body
            reply = p.reply
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
            # kept (Note [raising a kept error]), in the words the appliance uses for a
            # request that named it before this reply was read: every read says the same
            why = f"handle {r.handle!r}: its PUT failed: {exc.message}"
            r.failed = error_from_wire(exc.code, why)
            r._finalizer.detach()  # nothing on the appliance to free
        if self._lineage is not None:  # nor to put again after a recovery
            self._lineage.record_frees([r.handle for r in p.remotes], None)
