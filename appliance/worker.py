"""An executor worker: one process per device, serving the sessions pinned to it.

Started by the supervisor as ``python -m djinn.appliance.worker --control-fd N``. It maps
its share of the host arena, opens its device, reports ``ready``, then runs one selector
loop over the control channel and every session connection the supervisor hands it
(passed as file descriptors, so requests then go client <-> worker with no relay).

Single-threaded on purpose: one device executes one request at a time anyway, and the
loop never blocks on a client: replies a slow reader does not take at once wait in the
session's outbox and are continued from the loop (Note [slow readers], outbox.py).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import logging
import os
import selectors
import signal
import socket
import sys
import time
import weakref
from collections.abc import Iterator
from typing import Any

from djinn.errors import (
    DjinnError,
    ExecutionError,
    InternalError,
    ProtocolError,
    SessionEnded,
    SessionExpired,
)
from djinn.protocol.frames import Frame, Kind, encode_error, encode_frame
from djinn.transport.arena import ArenaMapping
from djinn.transport.framing import FrameReader, PeerClosed
from djinn.transport.spin import Spin

from . import (
    control,
    device_lost,
    gc_freeze,
    leases,
    parking,
    prewarm,
    receive,
    worker_memory,
    worker_stats,
)
from .admission import AdmissionQueue
from .batching import Batcher
from .busy import BusyTracker
from .executor import threads
from .executor.cuda_graphs import CudaGraphs
from .executor.device import open_device
from .executor.plan import GraphPlans
from .graphs import GraphTemplates
from .handlers import HANDLERS, STEPPED, put_refused
from .memtrim import keep_heap_warm, trim_heap
from .models import ModelCache
from .reqstats import RequestStats
from .request_kinds import IMMEDIATE, UNSCHEDULED
from .scheduler import Work, scheduler_from, tenant_of, work_facts
from .sessions import CLOSED, ENDED, OPEN, WorkerSession
from .store import TensorStore
from .uploads import PARKED, UPLOADING_KINDS, Uploads
from .utilisation import Utilisation
from .vmu.device import DeviceShort, DeviceVMU

log = logging.getLogger("djinn.appliance.worker")

LOOP_TICK_S = 0.1  # lease sweep and stats push granularity


class Worker:
    def __init__(self, ctl: socket.socket, init: dict[str, Any]) -> None:
        self.ctl = ctl
        self.id = init["worker"]
        self.inline_max = init["inline_max"]
        self.lease_s = init["lease_s"]
        self.heartbeat_interval = init["heartbeat_interval"]
        self.model_roots = [r for r in str(init.get("model_roots", "")).split(":") if r]
        self.device = open_device(
            init["device"], init["cpu_worker_memory"], init.get("gpu_worker_memory", "auto")
        )
        if self.device.torch_device.type == "cpu":
            keep_heap_warm()  # Note [warm heap]: swap-ins copy into warm pages
            if int(init.get("cpu_threads") or 0) > 0:  # its share of the cores
                threads.configure(int(init["cpu_threads"]))
            # Note [a capturing client beside its worker]
            threads.beside_client = bool(init.get("cpu_threads_beside_client", False))
        self.arena = ArenaMapping(init["arena_name"], init["arena_size"])
        self.pinned = self.device.register_host_memory(self.arena.address(), self.arena.size)
        capacity = self.device.capacity(init["workers"])
        # Note [one device budget]: the fractions are optional caps now (0: none)
        vmu = DeviceVMU(capacity, init["text_fraction"], init["data_fraction"])
        self.store = TensorStore(
            self.arena,
            init["arena_base"],
            init["arena_share"],
            vmu,
            session_max=init.get("arena_session_max", 1.0),
            reserve=init.get("arena_reserve", 0.0),
            sessions=lambda: sum(s.state == OPEN for s in self.sessions.values()),
        )
        allowlist = _csv(init.get("model_allowlist", "transformers."))
        self.models = ModelCache(vmu["text"], allowlist)
        # Note [prewarm]: once ready, unless the operator turned it off
        wanted = prewarm.modules_for(allowlist) if init.get("prewarm", True) else ()
        self.prewarm = prewarm.Prewarm(wanted)
        self.freezer = gc_freeze.FreezeImports()  # Note [frozen imports]
        self.sweep_due = 0.0
        self.memory = worker_memory.memory_manager(self, init)
        # Note [admission queue] (admission.py)
        self.admission = AdmissionQueue(float(init.get("admission_timeout", 0.0)))
        self.admission.release = vmu["stack"].release
        self.uploads = Uploads()  # Note [one upload per fingerprint] (uploads.py)
        self.ready: collections.deque[tuple[WorkerSession, Frame]] = collections.deque()
        self.model_methods = set(_csv(init.get("model_methods", "generate")))
        self.sessions: dict[int, WorkerSession] = {}
        self.sel = selectors.DefaultSelector()
        self.spin = Spin(float(init.get("worker_spin_us", 0.0)))  # Note [spin before sleeping]
        self.sel.register(ctl, selectors.EVENT_READ, None)
        self.requests = RequestStats(init.get("stats_window", 60.0))
        self.stopping = False
        self.busy_until = 0.0  # Note [busy worker]
        self.stats_dirty = True
        self.last_push = 0.0
        self._trim_due = False  # Note [heap trim] (memtrim.py)
        self.scheduler = scheduler_from(init)  # Note [threading model] (scheduler.py)
        self.batcher = Batcher(self.scheduler.batch_max)  # Note [cross-session batching]
        self.graphs = GraphTemplates()  # Note [graph templates]
        self.plans = GraphPlans(  # Note [graph plans], Note [compiled plans]
            int(init.get("graph_plan_after", 2)),
            compile_after=int(init.get("graph_compile_after", 1)),
        )
        self.cuda_graphs = CudaGraphs(  # Note [CUDA graphs for plans]
            bool(init.get("cuda_graphs", True)), int(init.get("cuda_graph_bytes", 1 << 30))
        )
        self.plans.dropped = self.cuda_graphs.forget
        self.adopted = 0  # sessions adopted so far: the supervisor's opening rows end here
        self.utilisation = Utilisation(init["device"])
        self.busy = BusyTracker(
            worker_stats.STATS_PUSH_S, lambda: worker_stats.send(self, time.monotonic(), False)
        )

    # -- main loop ----------------------------------------------------------------------
    def run(self) -> int:
        control.send(
            self.ctl,
            {"op": "ready", "pid": os.getpid(), "device": self.device.name, "pinned": self.pinned},
        )
        worker_stats.push(self, force=True)
        self.busy.start()  # Note [busy stats] (busy.py)
        self.freezer.at_ready()  # Note [frozen imports] (gc_freeze.py)
        self.prewarm.start()
        while not self.stopping:
            try:
                if not self.step():
                    return 0  # supervisor gone: nothing left to serve for
            except Exception:  # a bug costs a log line, never the worker
                log.exception("worker %s: error in the serving loop", self.id)
        self.drain()
        return 0

    def step(self) -> bool:
        # with work scheduled, only look at the sockets between two slices of it
        # (a decode step may be held a moment for others to batch with: wait_s)
        # Note [spin before sleeping]: polled for a moment first, if the last wait was short
        timeout = self.scheduler.wait_s() if self.scheduler else LOOP_TICK_S
        ready = self.spin.select(self.sel, timeout)
        if not ready and not self.scheduler and self._trim_due:  # Note [heap trim]
            self._trim_due = False
            trim_heap()
        for key, events in ready:
            if key.data is None:
                if not self.on_control():
                    return False
            elif events & selectors.EVENT_WRITE:
                self.on_writable(key.data)
            elif not self.scheduler.has(key.data):  # one request per session at a time
                self.serve(key.data)
        if self.scheduler:
            work = self.scheduler.run_slice(self._work_steps, self._work_done, self._batch)
            if work is not None and work.ran_s > self.lease_s / 4:
                # Note [busy worker], slice by slice: while a long request is under way
                # heartbeats are read between its slices, but late (a slice is one op, and
                # an op can take seconds): nobody's lease runs out until it is over.
                self.busy_until = time.monotonic()
        if not self.freezer.decided:  # Note [frozen imports]
            pristine = not self.adopted and not self.models.entries
            self.freezer.after_prewarm(self.prewarm.state, pristine)
        if self.admission.queue:
            parking.admit(self)
        while self.ready:  # parked requests whose wait is over
            s, frame = self.ready.popleft()
            if s.state == OPEN and s.sock.fileno() >= 0:
                self.dispatch(s, frame)
                self._serve_buffered(s)
        leases.sweep(self)
        worker_stats.push(self)
        return True

    def on_control(self) -> bool:
        try:
            got = control.recv(self.ctl)
        except OSError:
            got = None
        if got is None:
            log.warning("worker %s: supervisor went away, exiting", self.id)
            for s in list(self.sessions.values()):
                self.end_session(s, CLOSED)
            return False
        msg, fds = got
        op = msg.get("op")
        if op == "adopt" and fds:
            self.adopt(msg, fds[0])
        elif op == "kill":
            for s in list(self.sessions.values()):
                if s.id == msg.get("session") and s.state == OPEN:
                    self.end_by_operator(s, str(msg.get("by", "")), str(msg.get("at", "")))
        elif op == "drain":
            self.stopping = True
        for fd in fds[1:]:
            os.close(fd)
        return True

    # -- sessions -------------------------------------------------------------------------
    def adopt(self, msg: dict[str, Any], fd: int) -> None:
        sock = socket.socket(fileno=fd)
        sock.setblocking(False)
        reader = FrameReader(sock, authenticated=True)
        session = WorkerSession(
            msg["session"], msg["peer"], sock, reader, msg["via_unix"], self.lease_s
        )
        session.tenant = str(msg.get("tenant") or "") or tenant_of(session.peer)
        # Note [no session cycles]: the reader must not hold its session strongly. A
        # cycle (session -> reader -> sink -> session) outlives the session's end until a
        # full garbage collection, and with it the reader's buffer and everything the
        # session referenced: worker RSS crept up with session churn
        # (benchmarks/soak.py). Freed by reference counting, it is gone at once.
        ref = weakref.ref(session)
        reader.sink = lambda h, b, lengths: receive.sink(self, ref(), h, b, lengths)
        self.sessions[sock.fileno()] = session
        self.adopted += 1
        self.sel.register(sock, selectors.EVENT_READ, session)
        reply = {
            "session": session.id,
            "worker": self.id,
            "device": self.device.name,
            "heartbeat_interval": self.heartbeat_interval,
            "lease_s": self.lease_s,
            "inline_max": self.inline_max,
        }
        if session.via_unix:
            reply["arena"] = {"name": self.arena.name, "size": self.arena.size}
        if self.device.name.startswith("cpu"):
            # the threads a graph this session sends without waiting runs with (Note
            # [steps followed while the graph runs], djinn/frontend/replay_followed.py)
            reply["cpu_threads"] = (
                threads.for_graph("cpu", session.via_unix, True) or threads.base()
            )
        self.reply(session, msg["request_id"], reply, [])
        self.stats_dirty = True
        worker_stats.push(self, force=True)

    def end_session(self, s: WorkerSession, state: str) -> None:
        """Free everything the session holds. EXPIRED keeps the socket as a tombstone."""
        s.outbox.clear()  # drop reply bytes before the memory they view is freed
        cancelled = self.scheduler.cancel(s)  # a half-run graph gives back what it held
        if cancelled is not None:
            self.batcher.discard([cancelled.frame])  # a batched step it will never take
        # its client waits for the answers: the request under way, and one parked in the
        # admission queue (requests behind it, read next, get the tombstone's error)
        parking.unmute(self, s)
        unanswered = [w.frame for w in self.admission.queue if w.session is s]
        if cancelled is not None:
            unanswered.insert(0, cancelled.frame)
        if unanswered and state != CLOSED:
            gone: DjinnError = (
                SessionEnded(s.end_reason)
                if state == ENDED
                else SessionExpired(f"session {s.id} expired; its handles were freed")
            )
            for frame in unanswered:
                self.send_error(s, frame.request_id, gone)
        self.requeue(self.uploads.abandon(s.id))
        self.admission.forget(s.id)
        receive.free_frame_slabs(self, s)  # a payload cut off mid-way (Note [receive slabs])
        if s.state == OPEN:
            for fp in s.models:
                self.models.detach(fp, s.id)
            s.models.clear()
            self.store.free_objects(s)
            self.memory.forget_session(s)  # and their host copies
            self.store.free_session(s)
        s.state = state
        self._trim_due = True
        if state == CLOSED:
            fd = s.sock.fileno()
            if fd in self.sessions:
                self.sel.unregister(s.sock)
                del self.sessions[fd]
            s.sock.close()
        self.stats_dirty = True
        worker_stats.push(self, force=True)
        # requests already read in behind the one answered above (an operator's kill or
        # an expiry, never inside serve): the tombstone answers them, or the client
        # waits for ever for a reply no new bytes will prompt (a review's hang)
        self._serve_buffered(s)

    def end_by_operator(self, s: WorkerSession, by: str, at: str) -> None:
        """KILL_SESSION from `djinn top` or an operator's client: free everything, and
        keep a tombstone that tells the client who ended its session and when, so it
        does not blame a worker that is fine (issue 16 §3)."""
        s.end_reason = (
            f"session {s.id} was ended by an operator ({by or 'unknown'}) at {at}; "
            "its handles were freed. Open a new session."
        )
        log.warning("session %s (%s) ended by operator %s", s.id, s.peer, by or "unknown")
        # a reply already half on the wire cannot be followed by a clean error frame
        self.end_session(s, CLOSED if s.outbox else ENDED)

    def requeue(self, parked: list[tuple[WorkerSession, Frame]]) -> None:
        self.ready.extend(parked)

    # -- requests ------------------------------------------------------------------------
    def serve(self, s: WorkerSession) -> None:
        s.touch()  # bytes arriving prove the client alive, even mid-way through a long upload
        # replies go out in order first, and a session has one request scheduled at most;
        # one parked in the admission queue holds its place too: a PUT its client sent
        # behind it without waiting (Note [puts sent without waiting]) was answered first,
        # and the client read that reply as the parked request's
        ran_immediate = False
        while (
            s.sock.fileno() >= 0
            and not s.outbox
            and not self.scheduler.has(s)
            and not self.admission.waiting(s.id)
        ):
            try:
                frame = s.reader.poll()
            except PeerClosed:
                log.info("session %s: peer disconnected", s.id)
                self.end_session(s, CLOSED)
                return
            except ProtocolError as exc:
                self.send_error(s, 0, exc)
                self.end_session(s, CLOSED)
                return
            if frame is None:
                return
            if frame.kind in UNSCHEDULED:  # Note [unscheduled heartbeats]
                for _ in self.dispatch_steps(s, frame):
                    pass
            elif frame.kind in IMMEDIATE and not self.scheduler and not ran_immediate:
                # Note [immediate requests]; one per visit: a client streaming requests
                # without waiting must not keep the worker from its other sockets
                ran_immediate = True
                began = self.scheduler.clock()
                for _ in self.dispatch_steps(s, frame):
                    pass
                self.scheduler.ran_alone(s, began)
            else:
                self.scheduler.submit(s, frame, work_facts(s, frame, self.graphs.size_of))
            if not s.reader.buffered():
                return  # nothing pipelined: skip a recv that would only say EAGAIN

    def dispatch(self, s: WorkerSession, frame: Frame) -> None:
        """Run a request to its end (parked requests whose wait is over)."""
        for _ in self.dispatch_steps(s, frame, fresh=False):
            pass

    def _work_steps(self, work: Work) -> Iterator[Any]:
        return self.dispatch_steps(work.session, work.frame)

    def _batch(self, works: list[Work]) -> None:
        """Decode steps of one model from several sessions, computed as one batched
        forward (Note [cross-session batching]); each member finds its result when it
        runs."""
        self.batcher.precompute(self, works)

    def _work_done(self, work: Work) -> None:
        self._serve_buffered(work.session)

    def _serve_buffered(self, s: WorkerSession) -> None:
        if s.state != CLOSED and s.sock.fileno() >= 0 and not s.outbox and s.reader.buffered():
            self.serve(s)  # requests pipelined behind this one are already here

    def dispatch_steps(self, s: WorkerSession, frame: Frame, fresh: bool = True) -> Iterator[None]:
        """Handle one request; a stepped one (EXEC) yields between its ops. ``fresh``: the
        frame was just read, so the session's receive slabs are its own; a parked request
        dispatched again is not fresh, and meanwhile the session may be receiving another
        frame into slabs that must not be freed here (Note [receive slabs])."""
        rid = frame.request_id
        started = time.perf_counter()
        outcome = "ok"
        self.busy.current = (s.id, frame.kind.name, time.monotonic())  # Note [busy stats]
        try:
            if frame.error is not None:
                if frame.kind == Kind.PUT:  # its payload was refused as it came
                    put_refused(s, frame, frame.error)
                raise frame.error
            if s.state != OPEN:  # a tombstone: EXPIRED or ENDED
                if frame.kind == Kind.SESSION_CLOSE:
                    self.reply(s, rid, {"closed": True}, [])
                    self.end_session(s, CLOSED)
                    return
                if s.state == ENDED:
                    raise SessionEnded(s.end_reason)
                raise SessionExpired(
                    f"session {s.id} expired after {self.lease_s:.1f}s "
                    "without a heartbeat; its handles were freed"
                )
            s.touch()
            s.requests += 1
            self.store.release_slabs(s, frame.body.get("release"))
            released = frame.body.get("free"), frame.body.get("free_objects")
            worker_memory.free_released(self, s, *released)
            if frame.kind == Kind.SESSION_CLOSE:
                self.reply(s, rid, {"closed": True}, [])
                self.end_session(s, CLOSED)
                return
            handler = HANDLERS.get(frame.kind)
            if handler is None:
                raise ProtocolError(f"{frame.kind.name} is not a session request")
            if self.uploads.by_fp and frame.kind.name not in UPLOADING_KINDS:
                self.requeue(self.uploads.abandon(s.id))  # it moved on: not uploading
            if s.staged_bytes and frame.kind.name not in UPLOADING_KINDS | {"FREE"}:
                self.store.unstage(s)  # kept after its upload: charged from now on
            self.memory.begin(s, frame.kind.name)  # Note [session tensors on the host]
            stepped = STEPPED.get(frame.kind)
            if stepped is not None:
                result = yield from self._resumed(stepped(self, s, frame))
            else:
                result = handler(self, s, frame)
            if result is PARKED:
                return  # answered when dispatched again (Note [one upload per fingerprint])
            body, segments = result
            self.admission.ran(s, frame)
            self.stats_dirty = True
            self.reply(s, rid, body, segments)
        except DeviceShort as exc:
            payload = s.frame_private if fresh else 0  # Note [admission queue]: it waits too
            if self.admission.park(s, frame, exc, self.store.vmu.used, payload):
                if fresh:
                    s.frame_private = 0  # the queue holds its stack charge now
                outcome = "parked"  # answered when it fits or its deadline passes
                parking.mute(self, s)
                return
            outcome = exc.code
            self.admission.ran(s, frame)
            self.send_error(s, rid, exc)
        except DjinnError as exc:
            outcome = exc.code
            self.admission.ran(s, frame)
            self.send_error(s, rid, exc)
            if isinstance(exc, ExecutionError):  # a kernel failed: the context may be lost
                device_lost.exit_if_lost(self)
        except GeneratorExit:  # its session ended while it waited (Scheduler.cancel)
            outcome = "cancelled"
            raise
        except Exception as exc:  # a bug must cost one request, never the worker
            outcome = InternalError.code
            self.admission.ran(s, frame)
            log.exception("worker %s: request %s failed", self.id, frame.kind.name)
            self.send_error(s, rid, InternalError(f"{type(exc).__name__}: {exc}"))
            device_lost.exit_if_lost(self)
        finally:
            if outcome not in ("ok", "parked", "cancelled"):
                s.failed(frame.kind.name, rid)
            self.memory.end(s, frame.kind.name)
            self.busy.current = None
            self.batcher.discard([frame])  # a batched result its handler never took
            if fresh:
                receive.free_frame_slabs(self, s)
            elapsed = time.perf_counter() - started
            self.requests.record(frame.kind.name, outcome, elapsed)
            s.touch()  # the client could not heartbeat while we worked: count from now
            if elapsed > self.lease_s / 4:
                # Note [busy worker]: while one request ran, no other session's heartbeat
                # could be read. Nobody's lease runs out for time the worker was busy.
                self.busy_until = time.monotonic()

    def _resumed(self, steps: Iterator[Any]) -> Iterator[Any]:
        """Pass ``steps``' yields on (a DecodeStep tells the scheduler that a generate()
        loop waits for its next token); after each, this request is what the worker runs
        again (Note [busy stats])."""
        busy = self.busy.current
        try:
            while True:
                try:
                    value = next(steps)
                except StopIteration as stop:
                    return stop.value
                yield value
                self.busy.current = busy
        finally:
            steps.close()  # closed early (its session ended): its finally blocks run now

    def reply(self, s: WorkerSession, rid: int, body: dict, segments: list) -> None:
        self.send(s, encode_frame(Kind.REPLY, rid, body, segments))

    def send_error(self, s: WorkerSession, rid: int, exc: DjinnError) -> None:
        self.send(s, [encode_error(rid, exc.code, exc.message)])

    def send(self, s: WorkerSession, buffers: list) -> None:
        """Write what the socket takes now; the rest waits for the loop (Note [slow
        readers])."""
        if s.sock.fileno() < 0:
            return
        s.outbox.add(buffers)
        try:
            done = s.outbox.flush(s.sock)
        except OSError:
            self.end_session(s, CLOSED)
            return
        if not done:
            self.sel.modify(s.sock, selectors.EVENT_WRITE, s)

    def on_writable(self, s: WorkerSession) -> None:
        try:
            done = s.outbox.flush(s.sock)
        except OSError:
            self.end_session(s, CLOSED)
            return
        s.touch()
        if done:
            self.sel.modify(s.sock, selectors.EVENT_READ, s)
            if s.reader.buffered():
                self.serve(s)  # requests pipelined behind the reply are already here

    # -- shutdown -----------------------------------------------------------------------
    def drain(self) -> None:
        self.busy.stop()
        for s in list(self.sessions.values()):
            self.end_session(s, CLOSED)
        self.arena.close()


def _csv(text: str) -> list[str]:
    return [p.strip() for p in str(text).split(",") if p.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Djinn executor worker (started by djinn serve)")
    parser.add_argument("--control-fd", type=int, required=True)
    args = parser.parse_args(argv)
    # The supervisor owns signals: Ctrl-C in a terminal must not kill workers mid-request.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    ctl = socket.socket(fileno=args.control_fd)
    got = control.recv(ctl)
    if got is None:
        return 1
    init = got[0]
    logging.basicConfig(
        level=init.get("log_level", "WARNING").upper(),
        format=f"%(asctime)s worker{init['worker']} %(name)s %(levelname)s %(message)s",
    )
    try:
        worker = Worker(ctl, init)
    except Exception as exc:
        log.exception("worker %s failed to start", init.get("worker"))
        with contextlib.suppress(OSError):
            control.send(ctl, {"op": "failed", "error": f"{type(exc).__name__}: {exc}"})
        return 3
    return worker.run()


if __name__ == "__main__":
    code = main()
    # Note [quick exit]: a drained worker has ended its sessions and closed the arena;
    # what is left is the interpreter's teardown of torch, about a second of CPU that
    # every stop and restart of the appliance waited for. Flush what it would have
    # flushed, then leave without it.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
