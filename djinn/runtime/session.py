"""Session: a lease on the appliance that owns remote tensors.

Opening one hands a fresh connection to a worker; from then on requests go straight to
that worker. A background thread sends a heartbeat whenever the session has been idle
for a heartbeat interval, so a live but quiet program keeps its lease, and a dead one
loses it within ``interval * misses``.

Bulk bytes to a same-host appliance go through the shared-memory arena: ALLOC leases a
slab, the tensor is copied into it once, PUT hands it over. Over TCP the bytes follow the
PUT frame and the worker receives them straight into a slab.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from djinn.errors import (
    DjinnError,
    ProtocolError,
    SessionEnded,
    SessionExpired,
    SessionLost,
    WorkerLost,
    copy_of,
)
from djinn.protocol.frames import Frame, Kind

from . import kv_replay, lineage
from .channel import Channel
from .execs import NOT_RUN as NOT_RUN  # re-exported: djinn.frontend.trace reads it here
from .execs import Execs, _bytes_of, _u8
from .flights import Flight, Flights
from .graph_forms import GraphForms
from .puts import AHEAD_MAX, PutFlight, Puts
from .remote import RemoteTensor
from .slabs import LeasedSlabs

if TYPE_CHECKING:
    from .client import Client


class Session(Puts, Flights, Execs, GraphForms):
    def __init__(self, client: Client, *, recover: bool = False, avoid: int | None = None) -> None:
        self.client = client
        self._lost: str | None = None
        self._gone: DjinnError | None = None  # the SESSION_ENDED / _EXPIRED that said why
        self._graphs: set[str] = set()  # templates the appliance keeps for us (by fingerprint)
        self._pending_free: list[str] = []  # handles collected by the GC, freed next call
        self._release: list[int] = []  # reply slabs already copied out, released next call
        self._pending_free_objects: list[str] = []
        self._lists_lock = threading.Lock()
        self.objects_lock = threading.Lock()  # dedupes RemoteObjects (remote_module)
        self._closed = threading.Event()
        self._replaying = False  # a recovery replays the journal: nothing rides along
        # Note [asynchronous flushes]: an EXEC sent without waiting; every other request
        # reads its reply first (replies come in the order of the requests)
        self._flight: Flight | None = None
        self._puts: list[PutFlight] = []  # Note [puts sent without waiting], in order sent
        # Note [replays sent ahead]: graphs (and the puts after each) sent before the one
        # in flight, whose replies are unread; oldest first
        self._older: list[tuple[Flight, list[PutFlight]]] = []
        self._flight_lock = threading.RLock()
        # Note [lineage journal]: a recovering session records what it asks for, to
        # rebuild it on another worker when its own dies
        self._lineage: lineage.Lineage | None = None
        if recover:
            from djinn import config

            self._lineage = lineage.Lineage(self, lineage.Policy.from_config(config.load()))
            self._lineage.remotes = weakref.WeakSet()
        self._open(avoid)
        self._resume()

    def _open(self, avoid: int | None = None, prefer: int | None = None) -> None:
        """Open the session on the appliance: a new connection handed to a worker."""
        self.channel = Channel(self.client.address, self._lost_error, self.client.spin_us)
        self.channel.hello(self.client.token)
        body: dict[str, Any] = {"client": "python"}
        if avoid is not None:
            body["avoid"] = avoid  # a warm standby wants another worker
        if prefer is not None:
            body["prefer"] = prefer  # a recovery wants its standby's worker
        info = self.channel.call(Kind.SESSION_OPEN, body).body
        self.id: str = info["session"]
        self.worker: int = info["worker"]
        self.device: str = info.get("device", "")
        # a CPU worker's threads for a graph sent without waiting (None: not said)
        self.cpu_threads: int | None = info.get("cpu_threads")
        self.inline_max: int = info["inline_max"]
        self.heartbeat_interval: float = info["heartbeat_interval"]
        self.arena = self.client._map_arena(info["arena"]) if "arena" in info else None
        # Note [lease ahead]; a rebuilt session has none of the old worker's slabs
        self._spares = LeasedSlabs(self.arena.size if self.arena is not None else 0)
        self._last_call = time.monotonic()

    def _reopen(self) -> None:
        """A new session for this one after its worker was lost (Note [lineage journal]):
        what rode along with the lost requests is the old worker's business no more."""
        self.channel.close()
        self._replaying = True
        self._graphs = set()
        with self._lists_lock:
            self._release = []
        self._lost = None
        self._gone = None
        standby = self._lineage.standby if self._lineage is not None else None
        self._open(prefer=standby.worker if standby is not None else None)

    def _resume(self) -> None:
        """Requests carry the GC's frees again; a heartbeat thread for this connection."""
        self._replaying = False
        self._beat = threading.Thread(
            target=self._heartbeat,
            args=(self.channel,),
            name=f"djinn-heartbeat-{self.id}",
            daemon=True,
        )
        self._beat.start()

    # -- plumbing ---------------------------------------------------------------------------
    def _lost_error(self, why: str) -> DjinnError:
        if self._lost is None:
            self._lost = why
            return WorkerLost(
                f"the appliance worker serving session {self.id} went away "
                f"({why}); the request did not complete"
            )
        return SessionLost(
            f"session {getattr(self, 'id', '?')} is gone ({self._lost}); open a new session"
        )

    def _call(
        self, kind: Kind, body: dict[str, Any] | None = None, segments: Sequence = (), **kw: Any
    ) -> Any:
        self._settle()
        body = self._outgoing(body)
        try:
            frame = self.channel.call(kind, body, segments, **kw)
        except DjinnError as exc:
            self._not_done(exc, body)
            raise
        except BaseException as exc:  # Note [interrupted waits]
            if self.channel.closed:  # as if lost
                self._unsent(body)
            elif getattr(exc, "djinn_sent", False):  # the worker freed what rode along
                self._done(body)
            else:  # it never went (a wait for the channel's lock): the next one takes it
                self._unsent(body, always=True)
            raise
        self._done(body)
        return frame

    def _outgoing(self, body: dict[str, Any] | None) -> dict[str, Any]:
        """``body`` with what rides along with the next request: frees and slabs."""
        body = dict(body or {})
        with self._lists_lock:  # finalizers append from any thread
            if self._pending_free and not self._replaying:
                body["free"], self._pending_free = self._pending_free, []
            if self._release:
                body["release"], self._release = self._release, []
            if self._pending_free_objects and not self._replaying:
                body["free_objects"], self._pending_free_objects = self._pending_free_objects, []
        self._last_call = time.monotonic()
        return body

    def _not_done(self, exc: DjinnError, body: dict[str, Any]) -> None:
        if isinstance(exc, (SessionEnded, SessionExpired)):
            self._gone = copy_of(exc)  # the appliance freed it: nothing more will work
            self._unsent(body)
        elif isinstance(exc, (WorkerLost, SessionLost)):
            self._unsent(body)
        else:
            # the worker answered: it freed what rode along before it ran the request
            # (a graph sent behind a failed one among them), and the journal must not
            # rebuild those after a recovery (they stayed on the new worker for good)
            self._done(body)

    def _done(self, body: dict[str, Any]) -> None:
        if (
            self._lineage is not None
            and not self._replaying
            and ("free" in body or "free_objects" in body)
        ):
            self._lineage.record_frees(body.get("free"), body.get("free_objects"))

    def _unsent(self, body: dict[str, Any], always: bool = False) -> None:
        """A recovering session frees, after its recovery, what rode along with a lost
        request (Note [lineage journal]); the old worker's slabs are not ours any more.
        ``always``: a request that did not go, whatever the session (its slabs too)."""
        if self._lineage is None and not always:
            return
        with self._lists_lock:
            self._pending_free[:0] = body.get("free", [])
            self._pending_free_objects[:0] = body.get("free_objects", [])
            if always:
                self._release[:0] = body.get("release", [])

    def _call_raw(self, kind: str, body: dict[str, Any], segments: Sequence = ()) -> Any:
        return self._call(Kind[kind], body, segments).body

    def _recovering(self, attempt: Any, body: Any = None, repeat: bool = True) -> Any:
        """``attempt(body)``; in a recovering session, again on a rebuilt session when
        the worker is lost (Lineage.run)."""
        if self._lineage is None:
            return attempt(body)
        return self._lineage.run(attempt, body, repeat)

    @property
    def usable(self) -> bool:
        """False once the session is closed, lost with its worker or appliance, or ended
        or expired on the appliance: new work needs a new session. A recovering session
        stays usable after a loss until its recovery gives up (Note [lineage journal])."""
        if self._closed.is_set():
            return False
        rec = self._lineage
        if rec is not None and rec.gave_up is not None:
            return False
        if rec is not None:
            retried = rec.policy.errors
            lost_ok = self._lost is None or {"WORKER_LOST", "SESSION_LOST"} & retried
            gone_ok = self._gone is None or self._gone.code in retried
            return bool(lost_ok and gone_ok)
        return self._lost is None and self._gone is None

    def recovery_stats(self) -> dict[str, Any]:
        """Recoveries, their durations and the journal's size (empty when not recovering)."""
        return {} if self._lineage is None else self._lineage.stats()

    def _free_later(self, handle: str) -> None:
        if not self._closed.is_set():
            with self._lists_lock:
                self._pending_free.append(handle)

    def _free_object_later(self, oid: str) -> None:
        if not self._closed.is_set():
            with self._lists_lock:
                self._pending_free_objects.append(oid)

    def _heartbeat(self, channel: Channel) -> None:
        while not self._closed.wait(self.heartbeat_interval / 2):
            if self.channel is not channel:
                return  # the session was rebuilt: its own thread beats for it
            if time.monotonic() - self._last_call < self.heartbeat_interval / 2:
                continue
            # Note [a beat after a flight]: a graph the worker is running keeps the session
            # alive; once it has answered, the lease runs again, and a program that did not
            # read the answer yet (a backward pass's last graph, then a pause) lost its
            # session. Once the answer has arrived the beat goes: its request reads the
            # answer first (_call settles), as the program's next one would.
            if self._flight is not None and not self.channel.reply_waiting():
                continue
            try:
                self._call(Kind.HEARTBEAT)
            except DjinnError:
                return  # the next real call reports what happened

    # -- the model path (docs/protocol.md: REGISTER, CALL) -----------------------------------
    def register_model(self, body: dict[str, Any]) -> dict[str, Any]:
        """Offer a model by fingerprint (REGISTER); the reply says whether the appliance
        already has it (``cached``) or wants its weights in a second REGISTER."""
        if self._lineage is None:
            return self._call(Kind.REGISTER, body).body
        reply, sent = self._lineage.run_body(lambda b: self._call(Kind.REGISTER, b).body, body)
        self._lineage.record(lineage.Entry("register", sent, nbytes=lineage.NODE_BYTES))
        if "state" in sent or "path" in sent or reply.get("cached"):
            self._lineage.warm_standby()
        return reply

    def call_model(self, body: dict[str, Any], segments: Sequence = ()) -> dict[str, Any]:
        """Call a registered model (CALL); ``segments`` carry the inline tensors (and the
        generator state a ``generate()`` draws from: the reply's ``generator`` is then
        the state it left, as bytes; Note [a sampled model call])."""
        if self._lineage is None:
            return _call_reply(self._call(Kind.CALL, body, segments))
        repeat = not lineage.sampled(body)
        if self._lineage.policy.kv_prefill:  # Note [echoed ids]
            body = kv_replay.ask_echo(body)
        attempt = lambda b: _call_reply(self._call(Kind.CALL, b, segments))  # noqa: E731
        reply, sent = self._lineage.run_body(attempt, body, repeat)
        entry = lineage.Lineage.call_entry(sent, list(segments), reply)
        entry.seconds = self._lineage.took()
        self._lineage.record(entry)
        return reply

    def memory_allocated(self) -> int:
        """Bytes this session holds on the appliance now (tensors, KV caches)."""
        reply = self._recovering(lambda _: self._call(Kind.HEARTBEAT).body)
        return int(reply.get("bytes", 0))

    # -- tensors ---------------------------------------------------------------------------
    def _give_back(self, offsets: Iterable[int]) -> None:
        """Slabs to release with the next request: reply slabs copied out, spare slabs
        unused (Note [lease ahead])."""
        with self._lists_lock:
            self._release.extend(offsets)

    def get(self, remote: RemoteTensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Fetch a remote tensor's value. With ``out`` (a CPU tensor of the same shape and
        dtype) the bytes land in it, skipping a fresh allocation, whose pages are faulted
        in as the bytes are written (``benchmarks/transport.py``'s alloc+memcpy column); if
        an ``out=`` op on the appliance has resized the tensor since, InvalidArgument."""
        return self.get_many([remote], None if out is None else [out])[0]

    def get_many(
        self, remotes: Sequence[RemoteTensor], out: Sequence[torch.Tensor] | None = None
    ) -> list[torch.Tensor]:
        if out is not None:
            if len(out) != len(remotes):
                raise ValueError("out= needs one tensor per remote tensor")
            for r, o in zip(remotes, out, strict=True):
                if o.device.type != "cpu" or o.shape != r.shape or o.dtype != r.dtype:
                    raise ValueError(f"out= must be a CPU tensor of {list(r.shape)} {r.dtype}")

        failed: list[BaseException] = []

        def attempt(_: Any) -> list[torch.Tensor] | None:
            # again after a recovery: a put it could not make again. Given back, not
            # raised: a SESSION_LOST a rebuild left on a tensor is no fault to recover from
            # (a review saw three more rebuilds, then RECOVERY_FAILED)
            bad = next((r.failed for r in remotes if r.failed is not None), None)
            if bad is not None:  # a put that failed, or a value an op failed to write
                failed.append(bad)
                return None
            return self._get_many(remotes, out)

        got = self._recovering(attempt)
        if failed:
            raise copy_of(failed[0])
        return got

    def _get_many(
        self, remotes: Sequence[RemoteTensor], out: Sequence[torch.Tensor] | None = None
    ) -> list[torch.Tensor]:
        sink = self._sink if out is None else self._sink_into(out)
        body = {"handles": [r.handle for r in remotes]}
        if self._flight is None and self._puts and len(remotes) <= AHEAD_MAX:
            frame = self._get_behind_puts(body, sink)
        else:
            frame = self._call(Kind.GET, body, sink=sink)
        return self._unpack(frame, out)["tensors"]

    def _get_behind_puts(self, body: dict[str, Any], sink: Any) -> Frame:
        """A GET sent behind puts whose replies are unread, and read with them (Note [puts
        sent without waiting]): the worker runs it as soon as it has run them, and the
        client does not wait for their replies first. Theirs land after it, so one that
        failed holds its error whether or not this GET named it."""
        body = self._outgoing(body)
        try:
            frame = self.channel.call(Kind.GET, body, sink=sink, first=True)
        except DjinnError as exc:
            self._not_done(exc, body)
            raise
        finally:
            self._settle()
        self._done(body)
        return frame

    def inspect_weights(self, path: str) -> dict[str, Any]:
        """``{content_hash, names}`` of the safetensors files in ``path`` on the appliance
        host, without loading them."""
        body = {"path": str(path), "hash_only": True}
        return self._recovering(lambda b: self._call(Kind.LOAD, b).body, body)

    def load(self, path: str) -> dict[str, RemoteTensor]:
        """Have the appliance load the safetensors weights in ``path`` (a directory on the
        appliance host, under its ``model_roots``); returns them by name, bytes remote."""
        body = {"path": str(path)}
        reply = self._recovering(lambda b: self._call(Kind.LOAD, b).body, body)
        if self._lineage is not None:
            made = {t["name"]: t["handle"] for t in reply["tensors"]}
            self._lineage.record(lineage.Entry("load", body, out=made, nbytes=len(made) * 64))
        return {t["name"]: RemoteTensor(self, t["handle"], t) for t in reply["tensors"]}

    def free(self, handles: Iterable[str]) -> None:
        body = {"handles": list(handles)}
        if self._lineage is None:
            self._call(Kind.FREE, body)
            return
        _, sent = self._lineage.run_body(lambda b: self._call(Kind.FREE, b), body)
        self._lineage.record_frees(sent["handles"], None)

    @staticmethod
    def _sink(_header: Any, _body: Any, lengths: list[int]) -> list[memoryview]:
        # TCP replies: receive each segment straight into the memory of a new tensor.
        return [memoryview(_u8(n).numpy()) for n in lengths]

    @staticmethod
    def _sink_into(out: Sequence[torch.Tensor]) -> Any:
        def sink(_header: Any, body: dict[str, Any], lengths: list[int]) -> list[memoryview]:
            targets = [memoryview(_u8(n).numpy()) for n in lengths]
            for item, o in zip(body.get("tensors", []), out, strict=False):
                k = item.get("seg")
                direct = _bytes_of(o, item["desc"])
                fits = direct is not None and type(k) is int and 0 <= k < len(lengths)
                if fits and direct.numel() == lengths[k]:
                    targets[k] = memoryview(direct.numpy())
            return targets

        return sink

    def _arena_tensor(self, off: int, nbytes: int) -> torch.Tensor:
        assert self.arena is not None
        return torch.frombuffer(self.arena.slab(off, nbytes), dtype=torch.uint8)

    # -- lifetime ----------------------------------------------------------------------------
    def close(self) -> None:
        """Free everything the session holds on the appliance."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._lineage is not None:
            self._lineage.close()
        try:
            if self._lost is None:
                self._call(Kind.SESSION_CLOSE)
        except DjinnError:
            pass
        finally:
            self.channel.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Session(id={self.id}, worker={self.worker}, device={self.device!r})"


def _call_reply(frame: Frame) -> dict[str, Any]:
    """A CALL's reply body, its ``generator`` segment read into bytes."""
    k = frame.body.get("generator")
    if k is None:
        return frame.body
    if type(k) is not int or not 0 <= k < len(frame.segments):
        raise ProtocolError(f"a CALL reply names no payload segment {k!r} for its generator")
    return {**frame.body, "generator": bytes(frame.segments[k])}
