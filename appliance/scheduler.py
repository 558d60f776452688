"""The worker's scheduler: which session's request runs next, one slice at a time.

Note [threading model]: a worker is one thread, and that thread is the one place that
touches the device. Its loop alternates two things: reading (every socket with bytes,
non-blocking; a frame's payload lands in its buffers as it arrives, so a slow or huge
upload is read a piece per turn and never holds anything up) and running one slice of
scheduled work. A request that was read completely goes to the scheduler, not straight
to its handler; while a session has a request in the scheduler, the worker reads no
further frame of that session, so a session's requests run and are answered in order,
and one session can never queue more than one. A slice runs the request the policy
chooses until it finishes or ``slice_s`` has passed; a graph (EXEC) is a generator that
yields between ops, so the next slice may be another session's request while the graph
waits, holding its values, to be resumed exactly where it stopped (preemption at op
boundaries: the ops run in the same order on the same values, so results are
identical). Other requests (puts, gets, model calls) run whole within one slice. No
lock is needed anywhere: nothing runs concurrently, only interleaved at op boundaries.
A single op still runs to its end (a 2-second matmul holds the loop for 2 seconds).

Decode steps of one model from different sessions are run as one batch (Note
[cross-session batching], batching.py). A decode step is either a model call of one
token on a KV cache, or a ``generate()`` loop paused between two tokens: its generator
yields a ``DecodeStep``, which ends the slice. The scheduler's part: a decode step is
*held* (not chosen) for at most ``batch_wait_s`` while fewer steps of its model wait than
sessions decoded it within the last ``DECODERS_RECENT_S``, so that their next steps can
join. When one is chosen, the ``batch`` callback computes it together with the other
steps of its model that wait (at most ``batch_max``), and marks them ``batched``; they
stay in the scheduler and are run (answered, or resumed) before anything else, each
finding its result ready. The batch's time is shared among its members.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

from djinn.semantics.registry import default_registry
from djinn.semantics.scheduling import SchedulerPolicy, SchedulingView, WorkFacts

from .batching import DecodeStep, batch_key

log = logging.getLogger("djinn.appliance.scheduler")

MAX_TENANT_ROWS = 32  # tenants listed in the stats document (each TCP host is one)
USAGE_HALF_LIFE_S = 10.0  # fair shares look at recent execution time, decayed
DECODERS_RECENT_S = 1.0  # a session that decoded a model this recently will again soon


class Work:
    """One request in the scheduler."""

    __slots__ = (
        "arrived",
        "batched",
        "facts",
        "frame",
        "key",
        "ran_s",
        "session",
        "step",
        "steps",
    )

    def __init__(self, key: int, session: Any, frame: Any, facts: dict, arrived: float) -> None:
        self.key = key
        self.session = session
        self.frame = frame
        self.facts = facts  # what the policy sees of it, besides times and usage
        self.arrived = arrived
        self.ran_s = 0.0
        self.steps: Iterator[Any] | None = None
        self.step: DecodeStep | None = None  # a generate() loop paused at this decode step
        self.batched = False  # its decode step was computed in a batch: run it soon

    def pending_step(self) -> bool:
        """A decode step not computed yet: a model call not started, or a paused loop."""
        return (
            bool(self.facts.get("batch"))
            and not self.batched
            and (self.steps is None or self.step is not None)
        )

    def waiting_since(self) -> float:
        return self.step.since if self.step is not None else self.arrived


class Usage:
    """Execution seconds per key (tenant or session): exponentially decayed (what fair
    shares look at) and in total (what an operator compares with the weights)."""

    def __init__(self, half_life_s: float = USAGE_HALF_LIFE_S) -> None:
        self._rate = math.log(2) / half_life_s
        self._values: dict[str, tuple[float, float]] = {}  # key -> (value, at)
        self.totals: dict[str, float] = {}

    def add(self, key: str, seconds: float, now: float) -> None:
        self._values[key] = (self.get(key, now) + seconds, now)
        self.totals[key] = self.totals.get(key, 0.0) + seconds

    def get(self, key: str, now: float) -> float:
        value, at = self._values.get(key, (0.0, now))
        return value * math.exp(-self._rate * max(0.0, now - at))

    def forget(self, key: str) -> None:
        self._values.pop(key, None)
        self.totals.pop(key, None)

    def sessions(self) -> list[str]:
        return list(self._values)


def session_tenant(session: Any) -> str:
    """Whose session this is: the tenant the supervisor recorded (``token:NAME`` when the
    client presented a tenant's own token), else the one its peer says."""
    return getattr(session, "tenant", "") or tenant_of(session.peer)


def tenant_of(peer: str) -> str:
    """Whose session this is, from the peer the supervisor recorded: the Unix user (the
    kernel's uid) or the TCP client's address."""
    if peer.startswith("unix:"):
        uid = peer.partition("uid=")[2].split(",")[0]
        return f"uid:{uid}"
    if peer.startswith("tcp:"):
        return f"host:{peer[4:].rpartition(':')[0]}"
    return peer


def work_facts(
    session: Any, frame: Any, template_size: Callable[[Any], int] = lambda fp: 0
) -> dict[str, Any]:
    """What a policy may know of a request before it runs: its kind, and for a graph its
    size (a graph sent by template: the template's, never what the client says), for a
    model call its method, phase hint and input positions."""
    body = frame.body if isinstance(frame.body, dict) else {}
    facts: dict[str, Any] = {"kind": frame.kind.name, "phase": session.phase}
    if frame.kind.name == "EXEC":
        nodes = body.get("nodes")
        facts["nodes"] = len(nodes) if isinstance(nodes, list) else template_size(body.get("graph"))
    elif frame.kind.name == "CALL":
        method = body.get("method")
        facts["method"] = method if isinstance(method, str) else ""
        hints = body.get("hints")
        if isinstance(hints, dict) and isinstance(hints.get("phase"), str):
            facts["phase"] = hints["phase"][:32]
        facts["tokens"] = _positions(session, body)
        facts["batch"] = batch_key(body) if facts["tokens"] == 1 else ""
    return facts


def _positions(session: Any, body: dict[str, Any]) -> int:
    """Input positions of a model call (``input_ids``' elements), 0 if not told."""
    kwargs = body.get("kwargs")
    args = body.get("args")
    ids = kwargs.get("input_ids") if isinstance(kwargs, dict) else None
    if ids is None and isinstance(args, list) and args:
        ids = args[0]
    if not isinstance(ids, dict):
        return 0
    desc = ids.get("desc")
    if isinstance(desc, dict) and isinstance(desc.get("shape"), list):
        return math.prod(n for n in desc["shape"] if type(n) is int)
    handle = ids.get("$h")
    held = session.handles.get(handle) if isinstance(handle, str) else None
    return int(held[0].numel()) if held is not None else 0


def parse_weights(text: str) -> dict[str, float]:
    """``"uid:1000=2, host:10.0.0.7=0.5"`` -> {tenant: weight} (checked at config load)."""
    weights: dict[str, float] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        tenant, _, weight = part.rpartition("=")
        weights[tenant.strip()] = float(weight)
    return weights


class Scheduler:
    def __init__(
        self,
        policy: SchedulerPolicy | None,
        *,
        slice_s: float = 0.005,
        small_graph_nodes: int = 64,
        max_wait_s: float = 0.5,
        weights: dict[str, float] | None = None,
        batch_max: int = 1,
        batch_wait_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = policy
        self.slice_s = slice_s
        self.small_graph_nodes = small_graph_nodes
        self.max_wait_s = max_wait_s
        self.weights = weights or {}
        self.batch_max = batch_max
        self.batch_wait_s = batch_wait_s
        self.clock = clock
        self._decoders: dict[str, dict[str, float]] = {}  # batch key -> session -> last step
        self._items: dict[int, Work] = {}
        self._by_session: dict[str, Work] = {}
        self._next_key = 0
        self._running: int | None = None  # unfinished work that ran the last slice
        self._executing: Work | None = None
        self._tenants = Usage()
        self._sessions = Usage()
        self._policy_failed = False
        self.slices = 0
        self.preemptions = 0
        self.completed = 0
        self.longest_slice_s = 0.0  # a single op runs to its end: how long that was at most

    def __bool__(self) -> bool:
        return bool(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def has(self, session: Any) -> bool:
        return session.id in self._by_session

    def submit(self, session: Any, frame: Any, facts: dict[str, Any]) -> None:
        """Queue ``frame`` of ``session`` (the worker submits one per session at a time)."""
        if session.id in self._by_session:
            raise RuntimeError(f"session {session.id} already has a request scheduled")
        work = Work(self._next_key, session, frame, facts, self.clock())
        self._next_key += 1
        if facts.get("batch"):
            self._decoders.setdefault(facts["batch"], {})[session.id] = work.arrived
        self._items[work.key] = work
        self._by_session[session.id] = work

    def cancel(self, session: Any) -> Work | None:
        """The session ended: drop its request, closing a half-run graph (its ``finally``
        blocks give back what it held), and return it (its client still waits for an
        answer). The request running right now ends by itself: None."""
        work = self._by_session.get(session.id)
        self._sessions.forget(session.id)
        for decoders in self._decoders.values():
            decoders.pop(session.id, None)
        if work is None or work is self._executing:
            return None
        self._remove(work)
        if work.steps is not None:
            work.steps.close()
        return work

    def run_slice(
        self,
        start: Callable[[Work], Iterator[Any]],
        done: Callable[[Work], None],
        batch: Callable[[list[Work]], None] | None = None,
    ) -> Work | None:
        """Run the chosen request for one slice and return it; ``start(work)`` makes its
        generator, ``done(work)`` is called once it has finished and left the scheduler;
        ``batch(works)`` computes decode steps of one model together (marking those it
        computed ``batched``)."""
        if not self._items:
            return None
        now = self.clock()
        work = self._choose(now)
        if work is None:
            return None  # every request waits for a batch to fill (wait_s says how long)
        if self._running is not None and self._running in self._items and work.key != self._running:
            self.preemptions += 1
        if batch is not None and self.batch_max > 1 and work.pending_step():
            self._run_batch(work, batch)
        work.step, work.batched = None, False  # the step's result is ready, or it runs alone
        if work.steps is None:
            work.steps = start(work)
        finished = paused = False
        self._executing = work
        began = self.clock()
        deadline = began + self.slice_s
        try:
            while True:
                value = next(work.steps)
                if isinstance(value, DecodeStep):  # a generate() loop at its next token
                    value.since = self.clock()
                    work.step, work.facts["batch"] = value, value.key
                    self._decoders.setdefault(value.key, {})[work.session.id] = value.since
                    paused = True
                    break
                if self.clock() >= deadline:
                    break
        except StopIteration:
            finished = True
        except BaseException:
            finished = True
            raise
        finally:
            self._executing = None
            self.slices += 1
            end = self.clock()
            ran = end - began
            self.longest_slice_s = max(self.longest_slice_s, ran)
            work.ran_s += ran
            self._charge(work, ran, end)
            if finished:
                self._remove(work)
                self.completed += 1
        if finished:
            self._running = None
            done(work)
        else:  # a paused loop waits for its step: no preference to run it on
            self._running = None if paused else work.key
        return work

    def ran_alone(self, session: Any, began: float) -> None:
        """A request that ran at once, the scheduler holding nothing (Note [immediate
        requests] in request_kinds.py), since ``began`` (this scheduler's clock): counted and
        charged as the one slice it would have run in."""
        end = self.clock()
        ran = end - began
        self.slices += 1
        self.completed += 1
        self.longest_slice_s = max(self.longest_slice_s, ran)
        self._tenants.add(session_tenant(session), ran, end)
        self._sessions.add(session.id, ran, end)

    def _charge(self, work: Work, seconds: float, end: float) -> None:
        self._tenants.add(session_tenant(work.session), seconds, end)
        self._sessions.add(work.session.id, seconds, end)

    def _run_batch(self, work: Work, batch: Callable[[list[Work]], None]) -> None:
        """Compute ``work``'s decode step with the others of its model that wait; the
        batch's time is shared among its members."""
        key = work.facts["batch"]
        others = sorted(
            (w for w in self._items.values() if w is not work and w.facts.get("batch") == key),
            key=Work.waiting_since,
        )
        members = [work, *[w for w in others if w.pending_step()][: self.batch_max - 1]]
        began = self.clock()
        try:
            batch(members)
        finally:
            end = self.clock()
            for w in members:
                w.ran_s += (end - began) / len(members)
                self._charge(w, (end - began) / len(members), end)

    def _remove(self, work: Work) -> None:
        self._items.pop(work.key, None)
        if self._by_session.get(work.session.id) is work:
            del self._by_session[work.session.id]
        if self._running == work.key:
            self._running = None

    # -- batches (Note [cross-session batching]) ------------------------------------------
    def _held(self, now: float) -> set[int]:
        """Keys of decode steps left waiting for the steps of their model's other decoders."""
        if self.batch_max <= 1:
            return set()
        groups: dict[str, list[Work]] = {}
        for w in self._items.values():
            if w.pending_step():
                groups.setdefault(w.facts["batch"], []).append(w)
        held: set[int] = set()
        for key, members in groups.items():
            oldest = min(w.waiting_since() for w in members)
            if now - oldest >= self.batch_wait_s or len(members) >= self.batch_max:
                continue
            decoders = self._decoders.get(key, {})
            for sid in [sid for sid, t in decoders.items() if now - t >= DECODERS_RECENT_S]:
                del decoders[sid]  # stopped decoding: nobody waits for it
            if len(decoders) > len(members):
                held.update(w.key for w in members)
        return held

    def wait_s(self) -> float:
        """How long the worker may wait on its sockets before a slice is due: 0 when a
        request can run now, else until the oldest held decode step stops waiting."""
        now = self.clock()
        held = self._held(now)
        if not self._items or len(held) < len(self._items):
            return 0.0
        oldest = min(w.waiting_since() for w in self._items.values())
        return max(0.0, oldest + self.batch_wait_s - now)

    def _choose(self, now: float) -> Work | None:
        batched = [w for w in self._items.values() if w.batched]
        if batched:  # a batch's members first: their results are ready and held in memory
            return min(batched, key=Work.waiting_since)
        held = self._held(now)
        ready = [w for w in self._items.values() if w.key not in held]
        if len(ready) <= 1:
            return ready[0] if ready else None
        view = SchedulingView(
            items=tuple(self._facts(w, now) for w in ready),
            running=self._running if self._running in self._items else None,
            small_graph_nodes=self.small_graph_nodes,
            max_wait_s=self.max_wait_s,
        )
        try:
            work = self._items.get(self.policy.choose(view)) if self.policy else None
        except Exception:  # a plugin's bug must not stop the worker: fall back to arrival
            if not self._policy_failed:
                log.exception("scheduling policy %r failed; using arrival order", self.policy)
                self._policy_failed = True
            work = None
        if work is None or work.key in held:
            work = min(ready, key=lambda w: w.arrived)
        return work

    def _facts(self, work: Work, now: float) -> WorkFacts:
        tenant = session_tenant(work.session)
        weight = self.weights.get(tenant, 1.0)
        return WorkFacts(
            key=work.key,
            session=work.session.id,
            tenant=tenant,
            arrived_s=work.arrived,
            waited_s=now - work.arrived,
            ran_s=work.ran_s,
            weight=weight,
            tenant_used_s=self._tenants.get(tenant, now) / weight,
            session_used_s=self._sessions.get(work.session.id, now) / weight,
            **work.facts,
        )

    def session_stats(self) -> dict[str, dict[str, Any]]:
        """Per session: its share of the worker's recent execution time (decayed, as the
        fair shares see it), its execution seconds since it opened, and the class its
        waiting request has under the policy (``classify``, if the policy has one; "" when
        nothing of it waits)."""
        now = self.clock()
        used = {sid: self._sessions.get(sid, now) for sid in self._sessions.sessions()}
        total = sum(used.values())
        rows = {
            sid: {
                "exec_share": round(u / total, 4) if total else 0.0,
                "exec_s": round(self._sessions.totals.get(sid, 0.0), 4),
                "class": "",
            }
            for sid, u in used.items()
        }
        classify = getattr(self.policy, "classify", None)
        if self._items and callable(classify):
            view = SchedulingView(
                items=tuple(self._facts(w, now) for w in self._items.values()),
                running=self._running if self._running in self._items else None,
                small_graph_nodes=self.small_graph_nodes,
                max_wait_s=self.max_wait_s,
            )
            for facts in view.items:
                row = rows.setdefault(
                    facts.session, {"exec_share": 0.0, "exec_s": 0.0, "class": ""}
                )
                try:
                    row["class"] = str(classify(facts, view))[:32]
                except Exception:  # a plugin's bug costs a column, never the stats
                    row["class"] = "?"
        return rows

    def stats(self) -> dict[str, Any]:
        now = self.clock()
        waits = sorted(now - w.arrived for w in self._items.values())
        return {
            "policy": getattr(self.policy, "name", "arrival") if self.policy else "arrival",
            "queued": len(self._items),
            "oldest_wait_s": round(waits[-1], 4) if waits else 0.0,
            "slices": self.slices,
            "preemptions": self.preemptions,
            "completed": self.completed,
            "longest_slice_s": round(self.longest_slice_s, 4),
            "tenants": self.tenant_stats(),
        }

    def tenant_stats(self) -> dict[str, dict[str, float]]:
        """Per tenant that ran here (the ``MAX_TENANT_ROWS`` that ran longest): its weight
        and its execution seconds since the worker started."""
        totals = self._tenants.totals
        ranked = sorted(totals.items(), key=lambda kv: -kv[1])[:MAX_TENANT_ROWS]
        return {t: {"weight": self.weights.get(t, 1.0), "exec_s": round(s, 4)} for t, s in ranked}


def scheduler_from(init: dict[str, Any]) -> Scheduler:
    """The worker's scheduler, from the settings the supervisor sent it."""
    name = init.get("scheduler", "semantic")
    policy = default_registry().scheduler(name)
    if policy is None:
        log.warning("scheduler %r did not load: requests run in arrival order", name)
    return Scheduler(
        policy,
        slice_s=float(init.get("scheduler_slice_ms", 5.0)) / 1e3,
        small_graph_nodes=int(init.get("scheduler_small_graph", 64)),
        max_wait_s=float(init.get("scheduler_max_wait_ms", 500.0)) / 1e3,
        weights=parse_weights(str(init.get("scheduler_weights", ""))),
        batch_max=int(init.get("batch_max", 8)),
        batch_wait_s=float(init.get("batch_wait_us", 2000)) / 1e6,
    )
