"""Lineage: what a session needs to rebuild everything it holds on a new worker.

Note [lineage journal]: a recovering session (``client.session(recover=True)``; the
frontend's default session when ``recovery_retries`` > 0) records every request that
changes what it holds on the appliance, in the order they completed: puts, op graphs,
model registrations, model calls, weight loads and frees. Together these are the lineage
of every live handle and remote object, back to puts and factories, including the
in-place writes, aliasing and random ops (a seeded op carries the generator state it
ran with, Note [seeded ops] in frontend/seeded.py) that a per-handle DAG would have to
model separately. When the worker dies (WORKER_LOST, then SESSION_LOST), the session
opens a new one, on the replacement or on another worker, or on a restarted appliance,
and replays the journal there; every handle and object id the replay produces is mapped
to the one it replaces, the program's ``RemoteTensor`` and ``RemoteObject`` objects are
pointed at the new ones in place (nothing the program holds changes identity), and the
request that failed is sent again. Ops on one kind of worker are deterministic, so the
replayed values are the values the program computed, bit for bit (but for a KV cache
rebuilt by a prefill, and what is computed from it: to float rounding).

Where the data lives:
- *put data* is the client's own tensor, referenced, not copied: the program usually
  still holds it, and a module moved with ``.to()`` gave up its CPU tensors anyway. Its
  version counter is recorded; a tensor written in place after it was uploaded can no
  longer be replayed and recovery gives up with RECOVERY_FAILED rather than rebuild a
  wrong value. Puts are replayed lazily: only when a later request uses them or the
  program still holds them (a freed input costs no upload).
- *inline bytes* (small tensors and generator states in graphs, model-call inputs) are
  copied into the journal: they are small and the caller's buffers may be reused.
- *registered models* come back from the same journal: the weights a session uploaded
  are puts (the client's tensors); a model ghost-loaded from a directory on the
  appliance host is registered from that path again (nothing held on the client). A
  worker that already holds the model (cached) skips the upload.
- *KV caches* are remote objects; they are rebuilt by replaying the model calls that
  grew them: a live cache's plain decode steps merged into one prefill of their tokens
  (Note [kv prefill replay] in kv_replay.py: equal to float rounding), other calls
  step by step as recorded (``recovery_kv = "steps"``: all of them, bit for bit).

Note [lineage truncation]: the journal would grow with every step of a loop. Once its
bytes since the last cut pass ``recovery_checkpoint_bytes``, or replaying what it
recorded since would take longer than ``recovery_checkpoint_seconds`` (as long as those
requests took) and than the last cut took, the session reads back the value of every
live handle (one GET, before its next request) and the journal becomes: the weights
handed over to REGISTER, the registrations, one put of those values, and for each live
view the one op that makes it again from its base (a view restored apart from its base
would no longer share its bytes). The client then holds the live state once plus at
most the budget, whatever the number of steps, and a replay costs about the budget in
time. A cut is put off while the session holds a remote object (a KV cache cannot be
read back; the calls that grew it stay) or a view made by more than an op on handles;
it is tried again after an eighth of the replay that made it due (resetting the clock
instead let a training journal grow to twice its budget whenever a cut fell between
``backward()`` and the optimizer step; chaos.py's training recoveries reached 2.9 s).

Note [private views]: autograd keeps a weight's gradient as a view, the transpose of a
product its own graph made and kept nowhere else. No handle shares those bytes, so read
back and put again (the wire keeps any dense layout) it is the same tensor to every
later request: such a view does not hold a cut back (``journal.private_views``). A view
of another output the same graph kept (a weight uploaded inline and its transpose) is
made again from that output's handle. Measured over a 1,000-step Adam loop (tracemalloc,
benchmarks/lineage_memory.py): the journal peaked at 2.7 MiB with the default cuts.

Where this falls short of a perfect recovery, it says so rather than guess: a put
source written in place since (its version counter moved), a ``generate()`` that
sampled on the appliance whose outputs are still used, a replayed model call that
returns a different structure, all give RECOVERY_FAILED naming the original fault.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from djinn.errors import DjinnError, RecoveryFailed, SessionLost, Unavailable, WorkerLost, copy_of
from djinn.protocol import templates

from . import kv_replay
from .journal import (  # noqa: F401 - Entry and the helpers are this module's API too
    Entry,
    GraphFacts,
    _from_handles_only,
    _remade_views,
    apply_views,
    distinct_handles,
    entry_writes,
    kept,
    mark_views,
    needed,
    pair_ids,
    remap,
    sampled,
    strings_in,
    unchanged_puts,
    view_outputs,
    written_anywhere,
    written_handles,
)
from .replay import replay
from .standby import make_standby

if TYPE_CHECKING:
    from .remote import RemoteTensor
    from .session import Session

log = logging.getLogger("djinn.runtime.lineage")
NODE_BYTES = 700  # what one recorded graph node costs the client (its dicts; tracemalloc)
MAPS_KEPT = 16  # handle renamings kept for requests built before a recovery
MAX_FACTS = 64  # templates whose journal facts a session keeps (Note [journal facts of a template])


@dataclass(frozen=True)
class Policy:
    """``recovery_*`` settings: how often and how patiently a lost session is rebuilt."""

    retries: int = 3
    backoff: float = 0.2
    backoff_max: float = 2.0
    errors: frozenset[str] = frozenset({"WORKER_LOST", "SESSION_LOST"})
    checkpoint_bytes: int = 64 << 20
    checkpoint_seconds: float = 1.0
    standby: bool = False
    kv_prefill: bool = True  # Note [kv prefill replay]; False: every step, bit-exact

    @classmethod
    def from_config(cls, cfg: Any) -> Policy:
        return cls(
            retries=int(cfg.recovery_retries),
            backoff=float(cfg.recovery_backoff),
            backoff_max=float(cfg.recovery_backoff_max),
            errors=frozenset(e.strip().upper() for e in cfg.recovery_errors.split(",") if e),
            checkpoint_bytes=int(cfg.recovery_checkpoint_bytes),
            checkpoint_seconds=float(cfg.recovery_checkpoint_seconds),
            standby=bool(cfg.recovery_standby),
            kv_prefill=str(cfg.recovery_kv) == "prefill",
        )


class Lineage:
    """The journal of one recovering session, and its replay (Note [lineage journal])."""

    def __init__(self, session: Session, policy: Policy) -> None:
        self.s = session
        self.policy = policy
        self.entries: list[Entry] = []
        self.lock = threading.RLock()
        self.generation = 0
        self.maps: dict[int, dict[str, str]] = {}  # generation -> renaming it applied
        self.remotes: Any = None  # weakref.WeakSet of live RemoteTensors (set by Session)
        self.base_bytes = 0  # the snapshot and weights left by the last cut
        self.nbytes = 0  # everything the journal holds
        self.next_cut = policy.checkpoint_bytes
        self.gave_up: RecoveryFailed | None = None
        self.recoveries = 0
        self.recovery_s: list[float] = []  # from the fault to a rebuilt session
        self.replay_s: list[float] = []  # of which replaying the journal
        self.recovered_at: list[float] = []  # time.monotonic() when each one ended
        self.replayed: list[int] = []  # requests each replay sent
        self.replay_kinds: list[dict[str, float]] = []  # its seconds by kind of request
        self.checkpoints = 0
        self.read_back_bytes = 0  # values the cuts read back from the appliance
        self.peak_bytes = 0
        self.cut_due = False
        self.replay_cost = 0.0  # seconds the requests since the last cut took
        self.cut_after: float | None = None  # replay seconds for the next try, once put off
        self.cuts_put_off = 0
        self.last_cut_s = 0.0
        self._tls = threading.local()  # how long this thread's last request took
        self._facts: OrderedDict[str, GraphFacts] = OrderedDict()  # by template fingerprint
        self.standby: Session | None = None  # Note [warm standby]
        self._standby_lock = threading.Lock()
        self.standby_s: list[float] = []

    # -- recording ---------------------------------------------------------------------
    def took(self) -> float:
        """How long this thread's last successful request took."""
        return getattr(self._tls, "took", 0.0)

    def record(self, entry: Entry) -> None:
        # what it writes, worked out now rather than in the next cut, whose time decides
        # how soon the one after it comes (Note [unchanged puts])
        if entry.writes is None:
            entry.writes = entry_writes(entry)
        with self.lock:
            self.entries.append(entry)
            self.nbytes += entry.nbytes
            self.replay_cost += entry.seconds
            self.peak_bytes = max(self.peak_bytes, self.nbytes)
            # cut before the next request, once the program holds this one's results:
            # when the journal outgrew its bytes, or when replaying it would take longer
            # than recovery_checkpoint_seconds and than the last cut did (a cut's cost
            # is repaid by the replay it saves)
            due = self.cut_after if self.cut_after is not None else self._cut_seconds()
            slow = self.replay_cost >= due
            self.cut_due = slow or self.nbytes - self.base_bytes >= self.next_cut

    def _cut_seconds(self) -> float:
        """Replay seconds after which a cut is due."""
        return max(self.policy.checkpoint_seconds, 2 * self.last_cut_s)

    def _cut_later(self, share: int) -> bool:
        """A cut must wait: try again after an eighth of the replay (and a ``share`` of
        the bytes) that makes one due, not after as much again; a journal that has
        passed its budget still grows by at most an eighth before the next try."""
        self.cut_after = self.replay_cost + self._cut_seconds() / 8
        self.next_cut = self.nbytes - self.base_bytes + self.policy.checkpoint_bytes // share
        self.cuts_put_off += 1
        return False

    def record_put(self, tensors: list[torch.Tensor], remotes: list[RemoteTensor]) -> None:
        data = [kept(t) for t in tensors]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        self.record(Entry("put", None, data, [r.handle for r in remotes], nbytes))

    def record_frees(self, handles: list[str] | None, oids: list[str] | None) -> None:
        if handles:
            self.record(Entry("free", list(handles), nbytes=32 * len(handles)))
        if oids:
            self.record(Entry("free_objects", list(oids), nbytes=32 * len(oids)))

    @staticmethod
    def graph_entry(body: Any, segments: list, out: dict[str, Any]) -> Entry:
        kept = [None if k is None else k["handle"] for k in out.get("kept", [])]
        data = [bytes(s) for s in segments]
        nbytes = sum(len(d) for d in data) + NODE_BYTES * (templates.count(body, "nodes") + 1)
        return Entry("exec", body, data, kept, nbytes)

    @staticmethod
    def call_entry(body: dict[str, Any], segments: list, reply: dict[str, Any]) -> Entry:
        data = [bytes(s) for s in segments]
        nbytes = sum(len(d) for d in data) + 4 * NODE_BYTES
        out, ids = reply.get("out"), kv_replay.echoed(reply)
        return Entry("call", body, data, out, nbytes, not sampled(body), ids=ids)

    @staticmethod
    def mark_views(body: dict[str, Any], kept: list[Any]) -> None:
        mark_views(body, kept)

    def record_graph(
        self, entry: Entry, kept: list[Any], form: tuple[str, list[str], Any] | None
    ) -> None:
        """Record a graph's ``entry`` and mark its ``kept`` views; ``form`` (fingerprint,
        inputs, scalars), when known, lets its template's facts be worked out once (Note
        [journal facts of a template])."""
        handles = [None if k is None else k.handle for k in kept]
        if form is not None and distinct_handles(form[1], handles):
            fp, inputs, scalars = form
            facts = self._facts.get(fp)
            if facts is None:
                facts = self._facts[fp] = GraphFacts(entry.body, inputs, handles, scalars)
                while len(self._facts) > MAX_FACTS and self._facts:
                    self._facts.popitem(last=False)
            if facts.fits(inputs, handles, scalars):
                entry.writes, kinds = facts.of(inputs, handles)
                apply_views(kinds, kept)
                self.record(entry)
                return
        mark_views(entry.body, kept)
        self.record(entry)

    # -- retrying ----------------------------------------------------------------------
    def run(self, attempt: Callable[[Any], Any], body: Any = None, repeat: bool = True) -> Any:
        return self.run_body(attempt, body, repeat)[0]

    def run_body(
        self, attempt: Callable[[Any], Any], body: Any = None, repeat: bool = True
    ) -> tuple[Any, Any]:
        """``attempt(body)``, rebuilding the session and sending it again when the worker
        is lost (``recovery_errors``); ``body``'s handles are renamed for the new
        session. Returns the result and the body that produced it. ``repeat=False``: the
        session is rebuilt but the request is not sent again (its result would differ:
        sampling on the appliance)."""
        # a cut's settled graph may have rebuilt the session meanwhile
        body, gen = self.renamed(body, self.before_request())
        tries = 0
        while True:
            try:
                started = time.perf_counter()
                result = attempt(body)
                self._tls.took = time.perf_counter() - started
                return result, body
            except DjinnError as exc:
                if exc.code not in self.policy.errors or isinstance(exc, RecoveryFailed):
                    raise
                tries += 1
                if tries > max(1, self.policy.retries):
                    raise self._give_up(exc, f"the request failed {tries} times") from exc
                self.recover(exc, gen)
                body, gen = self.renamed(body, gen)
                if not repeat:
                    raise WorkerLost(
                        f"{exc.message}; the session was rebuilt, but this request samples "
                        "on the appliance and is not sent again (its result would differ)"
                    ) from exc

    def renamed(self, body: Any, gen: int) -> tuple[Any, int]:
        """``body``, built in generation ``gen``, with the handles of every rebuild since
        renamed; and the generation it is now in."""
        with self.lock:
            for g in range(gen, self.generation):
                body = remap(body, self.maps.get(g, {}))
            return body, self.generation

    def before_request(self) -> int:
        """Cut the journal if a cut is due; the generation the request is sent in."""
        with self.lock:  # a recovery under way in another thread finishes first
            gen = self.generation
            if self.cut_due:
                self.cut_due = False
                try:
                    self.checkpoint()
                except DjinnError as exc:  # the worker is going: the journal stays whole
                    log.info("lineage cut put off: %s", exc)
            return gen

    def resend(
        self, fault: DjinnError, gen: int, attempt: Callable[[Any], Any], body: Any
    ) -> tuple[Any, Any]:
        """A request sent without waiting whose reply was ``fault`` (Note [asynchronous
        flushes]): rebuild the session as ``run_body`` does, then send it again and wait."""
        if fault.code not in self.policy.errors or isinstance(fault, RecoveryFailed):
            raise fault
        self.recover(fault, gen)
        return self.run_body(attempt, self.renamed(body, gen)[0])

    def _give_up(self, fault: DjinnError, why: str) -> RecoveryFailed:
        err = RecoveryFailed(
            f"session {self.s.id} could not be rebuilt ({why}); the original fault: "
            f"{fault.code}: {fault.message}"
        )
        err.fault = copy_of(fault)
        err.__cause__ = fault  # as a caller's ``raise ... from`` would set it, for the kept copy
        self.gave_up = copy_of(err)  # the one returned is raised (Note [raising a kept error])
        return err

    # -- recovery ----------------------------------------------------------------------
    def recover(self, fault: DjinnError, gen: int) -> None:
        """Open a new session and replay the journal into it, with back-off, up to
        ``recovery_retries`` times; then point every live handle and object at its
        replayed twin. RecoveryFailed (naming ``fault``) when it gives up."""
        with self.lock:
            if self.generation != gen:
                return  # another thread rebuilt it while this one waited
            if self.gave_up is not None:
                raise copy_of(self.gave_up)
            started = time.perf_counter()
            last: DjinnError = fault
            for attempt in range(self.policy.retries):
                if attempt:
                    time.sleep(
                        min(self.policy.backoff * 2 ** (attempt - 1), self.policy.backoff_max)
                    )
                try:
                    self.s._reopen()
                    opened = time.perf_counter()
                    mapping, entries = replay(self)
                    break
                except (WorkerLost, SessionLost, Unavailable) as exc:
                    last = exc
                    log.warning("recovery attempt %d failed: %s", attempt + 1, exc)
                except RecoveryFailed as exc:
                    raise self._give_up(fault, exc.message) from exc
                except DjinnError as exc:
                    raise self._give_up(fault, f"replay failed: {exc.code}: {exc.message}") from exc
            else:
                why = f"{self.policy.retries} attempts; the last: {last.code}: {last.message}"
                raise self._give_up(fault, why)
            self._rebind(mapping)
            self.entries = entries
            self.nbytes = sum(e.nbytes for e in entries)
            self.maps[self.generation] = mapping
            self.maps.pop(self.generation - MAPS_KEPT, None)
            self.generation += 1
            self.recoveries += 1
            done = time.perf_counter()
            self.recovery_s.append(done - started)
            self.replay_s.append(done - opened)
            self.replay_cost = done - opened  # what the next replay would cost, at least
            self.recovered_at.append(time.monotonic())
            self.replayed.append(
                sum(e.kind not in ("put", "free", "free_objects") for e in entries)
            )
            self.s._resume()
            self.warm_standby()
            log.warning(
                "session rebuilt on worker %s after %s (%d requests replayed in %.2fs)",
                self.s.worker,
                fault.code,
                len(entries),
                self.recovery_s[-1],
            )

    def _remotes(self) -> list[RemoteTensor]:
        """Every RemoteTensor of the session (another thread may be adding one)."""
        for _ in range(100):
            try:
                return list(self.remotes or ())
            except RuntimeError:  # the WeakSet changed size while it was copied
                continue
        return list(self.remotes or ())

    def _live(self) -> dict[str, RemoteTensor]:
        live: dict[str, RemoteTensor] = {}
        for r in self._remotes():
            if r._finalizer.alive:
                live.setdefault(r.handle, r)
        return live

    def _objects(self) -> dict[str, Any]:
        known = self.s.__dict__.get("_remote_objects")
        return dict(known.items()) if known is not None else {}

    def _rebind(self, mapping: dict[str, str]) -> None:
        """Point the program's handles and objects at their replayed twins, in place."""
        for r in self._remotes():
            if not r._finalizer.alive:
                continue
            new = mapping.get(r.handle)
            if new is None:
                if r.failed is None:  # a put that failed again says why (replay.put_apart)
                    r.failed = SessionLost(
                        f"this tensor's value was not rebuilt after its worker was lost "
                        f"(session {self.s.id})"
                    )
                continue
            r.rebind(new)
            if isinstance(r.view, tuple):  # the op that made it, on the renamed bases
                r.view = (remap(r.view[0], mapping), r.view[1])
        known = self.s.__dict__.get("_remote_objects")
        if known is not None:
            for oid, obj in list(known.items()):
                del known[oid]
                new = mapping.get(oid)
                if new is not None:
                    obj.rebind(new)
                    known[new] = obj

    # -- truncation --------------------------------------------------------------------
    def checkpoint(self) -> bool:
        """Note [lineage truncation]: cut the journal to the live values (read back once)
        and the model registrations. False when a cut must wait."""
        started = time.perf_counter()
        with self.lock:
            # the graph in flight first (Note [asynchronous flushes]). Settled by the
            # read-back below instead, its entry was recorded into the journal this cut
            # then replaced: its outputs were neither in the snapshot nor in the journal,
            # and after a worker loss the next graph that read one got NOT_FOUND
            self.s._settle()
            if self._objects():
                return self._cut_later(4)
            live = self._live()
            remade = _remade_views(live)
            if remade is None:
                return self._cut_later(8)
            # puts handed over to the appliance (a model's weights, before or after the
            # REGISTER that takes them): neither held by the program nor freed
            with self.s._lists_lock:
                freed = set(self.s._pending_free)
            keep: list[Entry] = []
            handed: list[tuple[str, tuple[torch.Tensor, int]]] = []
            for e in self.entries:
                if e.kind == "put":
                    handed += [(h, d) for h, d in zip(e.out, e.data, strict=True) if h not in live]
                elif e.kind == "free":
                    freed.update(e.body)
                elif e.kind == "register":
                    keep.append(e)
            handed = [(h, d) for h, d in handed if h not in freed]
            if handed:
                nbytes = sum(t.numel() * t.element_size() for _, (t, _) in handed)
                keep.insert(
                    0, Entry("put", None, [d for _, d in handed], [h for h, _ in handed], nbytes)
                )
            # Note [unchanged puts]: a live put nothing has written into since is kept
            # as it is (the client holds its bytes already); only the rest is read back
            unchanged = unchanged_puts(self.entries, live, remade)
            if unchanged:
                nbytes = sum(t.numel() * t.element_size() for t, _ in unchanged.values())
                keep.append(Entry("put", None, list(unchanged.values()), list(unchanged), nbytes))
            handles = [h for h in live if h not in remade and h not in unchanged]
            values = self.s._get_many([live[h] for h in handles]) if handles else []
            if handles:
                data = [kept(v) for v in values]
                nbytes = sum(v.numel() * v.element_size() for v in values)
                keep.append(Entry("put", None, data, handles, nbytes))
                self.read_back_bytes += nbytes
            for h, (node, ref) in remade.items():  # views, made again from their bases
                body = {"nodes": [node], "keep": [ref], "fetch": []}
                keep.append(Entry("exec", body, [], [h], NODE_BYTES))
            self.entries = keep
            self.nbytes = self.base_bytes = sum(e.nbytes for e in keep)
            self.next_cut = self.policy.checkpoint_bytes
            self.checkpoints += 1
            self.replay_cost = 0.0
            self.cut_after = None
            self.last_cut_s = time.perf_counter() - started
            return True

    # -- warm standby -----------------------------------------------------------------
    def warm_standby(self) -> None:
        """Note [warm standby]: with ``recovery_standby``, keep this session's registered
        models on a second worker, through a session of its own there, so that the
        replay after a loss finds them cached (REGISTER answers ``cached``: no upload, no
        fingerprint check, no build). Made in the background after a registration and
        after each recovery (the old standby's worker is now this session's); it costs
        one more copy of the models in the appliance's memory."""
        if not self.policy.standby or self.s._closed.is_set():
            return
        threading.Thread(target=self._make_standby, name="djinn-standby", daemon=True).start()

    def _make_standby(self) -> None:
        with self._standby_lock:
            started = time.perf_counter()
            with self.lock:
                entries = list(self.entries)
            if not any(e.kind == "register" for e in entries):
                return
            old, self.standby = self.standby, None
            if old is not None and old.usable and old.worker != self.s.worker:
                self.standby = old  # still on another worker: nothing to do
                return
            standby = make_standby(self.s, entries)
            if standby is None:
                return
            if old is not None:
                old.close()
            self.standby = standby
            self.standby_s.append(time.perf_counter() - started)

    def close(self) -> None:
        with self._standby_lock:
            if self.standby is not None:
                self.standby.close()
                self.standby = None

    def stats(self) -> dict[str, Any]:
        return {
            "recoveries": self.recoveries,
            "recovery_s": list(self.recovery_s),
            "replay_s": list(self.replay_s),
            "recovered_at": list(self.recovered_at),
            "replayed": list(self.replayed),
            "replay_kinds": list(self.replay_kinds),
            "standby_worker": None if self.standby is None else self.standby.worker,
            "standby_s": list(self.standby_s),
            "checkpoints": self.checkpoints,
            "checkpoints_put_off": self.cuts_put_off,
            "checkpoint_read_bytes": self.read_back_bytes,
            "journal_entries": len(self.entries),
            "journal_bytes": self.nbytes,
            "journal_base_bytes": self.base_bytes,
            "journal_peak_bytes": self.peak_bytes,
        }
