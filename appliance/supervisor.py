"""The supervisor: `djinn serve`.

It owns the listening sockets, the host-arena segment and the workers, and never touches
a tensor or CUDA. A client connection starts here: HELLO authenticates it, then it may
ask for STATS, KILL_SESSION, or SESSION_OPEN. Opening a session picks the least-loaded
ready worker and hands the *connection itself* to that worker (SCM_RIGHTS), so every
later request on it goes straight to the worker with no relay through this process.

Discipline (after gunicorn's arbiter): signal handlers only record; a wake-up fd gets the
loop out of select; timeouts and exit codes are named constants below.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import selectors
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from djinn.config import Config
from djinn.errors import AuthFailed, DjinnError, ProtocolError, Unavailable
from djinn.protocol.frames import VERSION, Frame, Kind, encode_error, encode_frame
from djinn.transport.framing import FrameReader, PeerClosed, send_buffers

from . import control, listeners, stats
from .devices import worker_devices
from .reqstats import RequestStats
from .vmu.arena import HostArenaSegment, sweep_stale
from .workers import WorkerHandle

log = logging.getLogger("djinn.appliance.supervisor")

TICK_S = 0.1  # worker liveness and timer granularity: a dead worker is seen within this
PREAUTH_TIMEOUT_S = 10.0  # a connection must send HELLO within this
MAX_PREAUTH_CONNECTIONS = 256  # unauthenticated TCP connections at once (Note [pre-auth])
MAX_PREAUTH_PER_ADDRESS = 16
# The supervisor serves everyone from one thread: a client that does not read its reply
# (a stats document, an error) gets this long, not framing's 30 s.
WRITE_TIMEOUT_S = 2.0  # ... from one source address
PREAUTH_BUFFER = 4096  # read buffer per connection: frames here are tiny
ACCEPT_PAUSE_S = 0.5  # out of file descriptors: stop accepting for this long
ACCEPT_BATCH = 64  # connections accepted per wake-up of a listening socket
OPEN_WAIT_S = 30.0  # how long a SESSION_OPEN waits for a ready worker
READY_TIMEOUT_S = 120.0  # how long start-up waits for the first workers
EXIT_OK, EXIT_CONFIG, EXIT_NO_WORKERS = 0, 2, 3


@dataclass
class ClientConn:
    sock: socket.socket
    reader: FrameReader
    peer: str
    via_unix: bool
    authenticated: bool = False
    accepted: float = field(default_factory=time.monotonic)
    waiting_open: tuple[int, float] | None = None  # (request id, deadline)
    host: str = ""  # TCP source address (Note [pre-auth])
    extra: dict[str, Any] = field(default_factory=dict)


class Supervisor:
    def __init__(self, cfg: Config, *, parent_pid: int | None = None) -> None:
        self.cfg = cfg
        self.parent_pid = parent_pid
        self.started = time.time()
        self.sel = selectors.DefaultSelector()
        self.conns: dict[int, ClientConn] = {}
        self.stopping = False
        self.token = ""
        self.tenant_tokens: dict[str, str] = {}  # name -> token (tenant_tokens_file)
        self.addresses: dict[str, str] = {}
        self.listeners: list[tuple[socket.socket, bool]] = []
        self.arena: HostArenaSegment | None = None
        self.workers: list[WorkerHandle] = []
        self._wake_r, self._wake_w = socket.socketpair()
        self.requests = RequestStats(cfg.stats_window)
        self.latest_stats: dict[str, Any] | None = None  # read by the metrics thread
        self.metrics_server: Any = None
        self.accept_paused_until = 0.0

    # -- start-up -----------------------------------------------------------------------
    def setup(self) -> None:
        cfg = self.cfg
        _raise_fd_limit()
        sweep_stale()
        devices = worker_devices(cfg.gpus, cfg.cpu_workers)
        share = (cfg.arena_bytes // len(devices)) // 4096 * 4096
        self.arena = HostArenaSegment(share * len(devices))
        if cfg.socket_path:
            sock = listeners.unix_listener(cfg.socket_path)
            self.listeners.append((sock, True))
            self.addresses["unix"] = f"unix://{cfg.socket_path}"
        if cfg.tcp_enabled:
            self.token = listeners.ensure_token(cfg.token, cfg.token_file)
            self.tenant_tokens = listeners.load_tenant_tokens(cfg.tenant_tokens_file)
            sock = listeners.tcp_listener(cfg.tcp_host, cfg.tcp_port)
            host, port = sock.getsockname()[:2]
            self.listeners.append((sock, False))
            self.addresses["tcp"] = f"tcp://{host}:{port}"
        if not self.listeners:
            from djinn.errors import ConfigError

            raise ConfigError("nothing to listen on: set socket_path or tcp_enabled")
        for sock, via_unix in self.listeners:
            self.sel.register(sock, selectors.EVENT_READ, ("listen", via_unix))
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.sel.register(self._wake_r, selectors.EVENT_READ, ("wake", None))
        signal.set_wakeup_fd(self._wake_w.fileno())
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        for i, device in enumerate(devices):
            init = {
                "op": "init",
                "worker": i,
                "device": device,
                "workers": len(devices),
                "arena_name": self.arena.name,
                "arena_size": self.arena.size,
                "arena_base": i * share,
                "arena_share": share,
                "inline_max": cfg.inline_max_bytes,
                "arena_session_max": cfg.arena_session_max,
                "arena_reserve": cfg.arena_reserve,
                "heartbeat_interval": cfg.heartbeat_interval,
                "stats_window": cfg.stats_window,
                "lease_s": cfg.heartbeat_interval * cfg.heartbeat_misses,
                "cpu_worker_memory": cfg.cpu_worker_memory,
                "gpu_worker_memory": cfg.gpu_worker_memory,
                "text_fraction": cfg.vmu_text_fraction,
                "data_fraction": cfg.vmu_data_fraction,
                "memory_policy": cfg.memory_policy,
                "admission_timeout": cfg.admission_timeout,
                "session_device_max": cfg.session_device_max,
                "session_host_max": cfg.session_host_max,
                "kv_recompute": cfg.kv_recompute,
                "tenant_device_max": cfg.tenant_device_max,
                "tenant_host_max": cfg.tenant_host_max,
                "scheduler": cfg.scheduler,
                "scheduler_slice_ms": cfg.scheduler_slice_ms,
                "scheduler_small_graph": cfg.scheduler_small_graph,
                "scheduler_max_wait_ms": cfg.scheduler_max_wait_ms,
                "scheduler_weights": cfg.scheduler_weights,
                "batch_max": cfg.batch_max,
                "batch_wait_us": cfg.batch_wait_us,
                "log_level": cfg.log_level,
                "cpu_threads": cfg.cpu_threads,
                "cpu_threads_beside_client": cfg.cpu_threads_beside_client,
                "cpu_wait_policy": cfg.cpu_wait_policy,
                "model_roots": cfg.model_roots,
                "model_allowlist": cfg.model_allowlist,
                "model_methods": cfg.model_methods,
                "prewarm": cfg.prewarm,
                "graph_plan_after": cfg.graph_plan_after,
                "graph_compile_after": cfg.graph_compile_after,
                "cuda_graphs": cfg.cuda_graphs,
                "cuda_graph_bytes": cfg.cuda_graph_bytes,
                "worker_spin_us": cfg.worker_spin_us,
            }
            self.workers.append(WorkerHandle(i, device, init))
        for w in self.workers:
            self._start_worker(w)
        if cfg.metrics_port:
            from . import metrics

            self.metrics_server = metrics.start(
                cfg.metrics_host, cfg.metrics_port, lambda: self.latest_stats
            )
            self.addresses["metrics"] = (
                f"http://{cfg.metrics_host}:{self.metrics_server.server_port}/metrics"
            )

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.stopping = True  # record only; the loop does the work

    def _start_worker(self, w: WorkerHandle) -> None:
        w.start()
        assert w.ctl is not None
        w.ctl.setblocking(True)
        self.sel.register(w.ctl, selectors.EVENT_READ, ("worker", w))

    def wait_ready(self) -> int:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline and not self.stopping:
            if all(w.ready or not w.alive for w in self.workers):
                break
            self.step()
        return sum(w.ready for w in self.workers)

    def readiness_line(self) -> str:
        where = " ".join(f"{k}={v.split('://', 1)[1]}" for k, v in self.addresses.items())
        devices = ",".join(w.device_name or w.device for w in self.workers if w.ready)
        return f"djinn ready: {where} workers={sum(w.ready for w in self.workers)} [{devices}]"

    # -- loop ---------------------------------------------------------------------------
    def serve_forever(self) -> None:
        while not self.stopping:
            try:
                self.step()
            except Exception:  # a bug costs a log line, never the appliance
                log.exception("error in the supervisor loop")
        self.shutdown()

    def step(self) -> None:
        for key, _ in self.sel.select(TICK_S):
            tag, data = key.data
            if tag == "listen":
                for _ in range(ACCEPT_BATCH):  # drain a burst, but keep serving others
                    if not self._accept(key.fileobj, data):
                        break
            elif tag == "conn":
                self._serve_conn(data)
            elif tag == "worker":
                self._on_worker(data)
            elif tag == "wake":
                with contextlib.suppress(BlockingIOError):
                    self._wake_r.recv(512)
        self._tick()

    def _tick(self) -> None:
        now = time.monotonic()
        for w in self.workers:
            if w.alive and w.proc is not None and w.proc.poll() is not None:
                self._worker_died(w)
            elif not w.alive and w.restart_at is not None and now >= w.restart_at:
                w.restarts += 1
                try:
                    self._start_worker(w)
                except OSError as exc:  # out of processes or fds: try again later
                    log.error("cannot start worker %d: %s", w.id, exc)
                    w.restart_at = now + ACCEPT_PAUSE_S * 4
        if self.accept_paused_until and now >= self.accept_paused_until:
            self.accept_paused_until = 0.0
            for sock, via_unix in self.listeners:
                self.sel.register(sock, selectors.EVENT_READ, ("listen", via_unix))
        for conn in list(self.conns.values()):
            if not conn.authenticated and now - conn.accepted > PREAUTH_TIMEOUT_S:
                self._fail(conn, 0, AuthFailed("no HELLO in time"))
        for conn in list(self.conns.values()):
            pending = conn.waiting_open
            if pending and not self._try_open(conn) and now > pending[1]:
                self._fail(conn, pending[0], Unavailable("no worker became ready in time"))
        if self.metrics_server is not None:
            self.latest_stats = self.stats()  # a fresh object each tick: safe to read
        if self.parent_pid and os.getppid() != self.parent_pid:
            log.warning(
                "parent process %d exited; stopping the embedded appliance", self.parent_pid
            )
            self.stopping = True

    # -- client connections -------------------------------------------------------------
    def _accept(self, lsock: socket.socket, via_unix: bool) -> bool:
        """Accept one connection; False when there is none (or accepting is paused)."""
        try:
            sock, addr = lsock.accept()
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:  # EMFILE and friends: pause accepting, keep serving
            log.error("cannot accept connections (%s); pausing %.1fs", exc, ACCEPT_PAUSE_S)
            if not self.accept_paused_until:
                for listener, _ in self.listeners:
                    self.sel.unregister(listener)
            self.accept_paused_until = time.monotonic() + ACCEPT_PAUSE_S
            return False
        if not via_unix:
            self._admit_preauth(addr[0])
        sock.setblocking(False)
        if via_unix:
            pid, uid, _gid = listeners.peer_credentials(sock)
            peer = f"unix:pid={pid},uid={uid}"
            if not listeners.unix_peer_allowed(uid):
                self._reject(sock, AuthFailed(f"uid {uid} may not use this appliance"))
                return True
        else:
            listeners.set_nodelay(sock)
            peer = f"tcp:{addr[0]}:{addr[1]}"
        # No supervisor request carries a payload: refuse one on the header alone.
        reader = FrameReader(sock, authenticated=False, max_payload=0, buffer_size=PREAUTH_BUFFER)
        conn = ClientConn(sock, reader, peer, via_unix, host="" if via_unix else addr[0])
        self.conns[sock.fileno()] = conn
        self.sel.register(sock, selectors.EVENT_READ, ("conn", conn))
        return True

    def _admit_preauth(self, host: str) -> None:
        """Note [pre-auth]: connections that have not sent HELLO yet cost the appliance a
        descriptor and a buffer, so they are capped, and the cap must not be a way to
        lock real clients out. A new connection is always accepted; when its source
        address already holds MAX_PREAUTH_PER_ADDRESS unauthenticated connections, or
        all addresses together hold MAX_PREAUTH_CONNECTIONS, the *oldest* of them (of
        that address first) makes room. A real client sends HELLO within milliseconds of
        connecting and is authenticated long before it is the oldest; idle connections
        age out first, and a flood from one address only ever evicts its own.
        Authenticated and Unix (uid-checked) connections never count."""
        waiting = [c for c in self.conns.values() if not (c.authenticated or c.via_unix)]
        same = [c for c in waiting if c.host == host]
        if len(same) >= MAX_PREAUTH_PER_ADDRESS:
            pool = same
        elif len(waiting) >= MAX_PREAUTH_CONNECTIONS:
            pool = waiting
        else:
            return
        oldest = min(pool, key=lambda c: c.accepted)
        self._fail(oldest, 0, AuthFailed("no HELLO yet, and a newer connection needs the slot"))

    def _reject(self, sock: socket.socket, exc: DjinnError) -> None:
        with contextlib.suppress(OSError):
            sock.sendall(encode_error(0, exc.code, exc.message))
        sock.close()

    def _close(self, conn: ClientConn) -> None:
        fd = conn.sock.fileno()
        if fd in self.conns:
            self.sel.unregister(conn.sock)
            del self.conns[fd]
        conn.sock.close()

    def _fail(self, conn: ClientConn, rid: int, exc: DjinnError, *, close: bool = True) -> None:
        try:
            send_buffers(conn.sock, [encode_error(rid, exc.code, exc.message)], WRITE_TIMEOUT_S)
        except OSError:
            close = True
        conn.waiting_open = None
        if close:
            self._close(conn)

    def _serve_conn(self, conn: ClientConn) -> None:
        while conn.sock.fileno() >= 0 and conn.waiting_open is None:
            try:
                frame = conn.reader.poll()
            except PeerClosed:
                self._close(conn)
                return
            except ProtocolError as exc:
                self._fail(conn, 0, exc)
                return
            if frame is None:
                return
            started, outcome = time.perf_counter(), "ok"
            try:
                self._dispatch(conn, frame)
            except DjinnError as exc:
                outcome = exc.code
                self._fail(conn, frame.request_id, exc, close=not conn.authenticated)
            self.requests.record(frame.kind.name, outcome, time.perf_counter() - started)

    def _dispatch(self, conn: ClientConn, frame: Frame) -> None:
        rid = frame.request_id
        if not conn.authenticated:
            if frame.kind != Kind.HELLO:
                raise AuthFailed("authenticate with HELLO before any other request")
            if not conn.via_unix:
                offered = frame.body.get("token")
                tenant = listeners.tenant_of_token(self.tenant_tokens, offered)
                if tenant is None and not listeners.token_matches(self.token, offered):
                    log.warning("rejected %s: wrong or missing token", conn.peer)
                    raise AuthFailed("wrong or missing token (set DJINN_TOKEN or token_file)")
                if tenant is not None:  # its own token: fair shares by tenant
                    conn.extra["tenant"] = f"token:{tenant}"
            conn.authenticated = True
            conn.reader.authenticated = True
            conn.extra["hello"] = _said_hello(frame.body)
            self._reply(conn, rid, {"protocol": VERSION, "server": "djinn", "pid": os.getpid()})
            return
        if frame.kind == Kind.STATS:
            self._reply(conn, rid, self.stats())
        elif frame.kind == Kind.PING:
            self._reply(conn, rid, {})
        elif frame.kind == Kind.KILL_SESSION:
            killed = self._kill_session(frame.body.get("session"), _operator(conn))
            self._reply(conn, rid, {"killed": killed})
        elif frame.kind == Kind.SESSION_OPEN:
            if conn.reader.buffered():
                raise ProtocolError("bytes pipelined after SESSION_OPEN; wait for its reply")
            conn.waiting_open = (rid, time.monotonic() + OPEN_WAIT_S)
            conn.extra["client"] = str(frame.body.get("client", ""))[:64]
            # worker ids a recovering client asks for (Note [warm standby]); hints only
            for key in ("prefer", "avoid"):
                value = frame.body.get(key)
                conn.extra[key] = value if type(value) is int else None
            self._try_open(conn)
        else:
            raise ProtocolError(f"{frame.kind.name} needs an open session")

    def _reply(self, conn: ClientConn, rid: int, body: dict[str, Any]) -> None:
        try:
            send_buffers(conn.sock, encode_frame(Kind.REPLY, rid, body), WRITE_TIMEOUT_S)
        except OSError:
            self._close(conn)

    def _try_open(self, conn: ClientConn) -> bool:
        """Hand the connection to the least-loaded ready worker. True once handed over."""
        ready = [w for w in self.workers if w.ready and w.ctl is not None]
        if not ready or conn.waiting_open is None:
            return False
        prefer, avoid = conn.extra.get("prefer"), conn.extra.get("avoid")
        w = min(ready, key=lambda w: (w.id == avoid, w.id != prefer, w.session_count(), w.id))
        msg = {
            "op": "adopt",
            "session": secrets.token_hex(8),
            "peer": conn.peer,
            "tenant": conn.extra.get("tenant", ""),
            "via_unix": conn.via_unix,
            "request_id": conn.waiting_open[0],
        }
        try:
            control.send(w.ctl, msg, [conn.sock.fileno()])
        except OSError:
            return False
        # a full row until the worker reports the session: readers of the stats document
        # (djinn status, top) find every field of it, also while the worker is busy
        w.handed_over(msg["session"], conn.peer)
        conn.waiting_open = None
        self._close(conn)  # the worker holds the only copy of the connection now
        return True

    def _kill_session(self, session: Any, by: str) -> bool:
        """End a session for an operator (``by``: their connection's peer). Its client is
        told SESSION_ENDED with who and when (issue 16 §3)."""
        at = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        for w in self.workers:
            if w.ctl is not None and (
                session in w.opening
                or any(s.get("id") == session for s in w.stats.get("sessions", []))
            ):
                try:
                    control.send(w.ctl, {"op": "kill", "session": session, "by": by, "at": at})
                except OSError:  # the worker just died: its sessions are gone anyway
                    return False
                log.warning("session %s ended by operator %s", session, by)
                w.opening.pop(session, None)
                w.stats["sessions"] = [
                    s for s in w.stats.get("sessions", []) if s.get("id") != session
                ]
                return True
        return False

    # -- workers ------------------------------------------------------------------------
    def _on_worker(self, w: WorkerHandle) -> None:
        try:
            got = control.recv(w.ctl) if w.ctl is not None else None
        except OSError:
            got = None
        if got is None:
            self._worker_died(w)
            return
        msg, fds = got
        for fd in fds:
            os.close(fd)
        op = msg.get("op")
        if op == "ready":
            w.ready = True
            w.ready_at = time.monotonic()
            w.device_name = msg.get("device", w.device)
            w.pid = msg.get("pid", w.pid)
            if msg.get("pinned"):
                self.arena_pinned = True
            log.info("worker %d ready on %s (pid %s)", w.id, w.device_name, w.pid)
        elif op == "stats_part":  # Note [stats in parts] (worker_stats.py)
            w.stats_parts.append(msg.get("sessions", []))
        elif op == "stats":
            parts, w.stats_parts = w.stats_parts, []
            if len(parts) == msg.get("parts", 0):
                msg["sessions"] = [row for part in parts for row in part]
                w.reported(msg)
            # else: a part was lost (the worker skipped a push): keep the previous stats
        elif op == "failed":
            w.last_error = str(msg.get("error", ""))[:500]

    def _worker_died(self, w: WorkerHandle) -> None:
        if w.ctl is not None:
            self.sel.unregister(w.ctl)
        w.mark_dead(self.cfg.restart_backoff_max, self.cfg.restart_backoff_reset)

    def stats(self) -> dict[str, Any]:
        assert self.arena is not None
        arena = {
            "name": self.arena.name,
            "size": self.arena.size,
            "pinned": getattr(self, "arena_pinned", False),
        }
        return stats.build(
            self.workers,
            arena,
            self.started,
            self.addresses,
            self.requests.snapshot(),
            self.cfg.stats_window,
        )

    # -- shutdown -----------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop accepting, let workers finish their current request, remove every trace."""
        for sock, via_unix in self.listeners:
            self.sel.unregister(sock)
            sock.close()
            if via_unix and self.cfg.socket_path:
                with contextlib.suppress(OSError):
                    os.unlink(self.cfg.socket_path)
                if self.parent_pid:
                    # An appliance tied to a parent (embedded) listens in a private
                    # directory made for it; a parent killed before its atexit ran cannot
                    # remove it, so the appliance does once it is empty.
                    with contextlib.suppress(OSError):
                        os.rmdir(os.path.dirname(self.cfg.socket_path))
        for conn in list(self.conns.values()):
            self._close(conn)
        for w in self.workers:
            if w.alive and w.ctl is not None:
                with contextlib.suppress(OSError):
                    control.send(w.ctl, {"op": "drain"})
        deadline = time.monotonic() + self.cfg.drain_timeout
        for w in self.workers:
            if w.proc is None:
                continue
            try:
                w.proc.wait(max(0.0, deadline - time.monotonic()))
            except Exception:
                w.proc.kill()
                w.proc.wait()
            w.alive = False
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
        if self.arena is not None:
            self.arena.unlink()
        signal.set_wakeup_fd(-1)


def _said_hello(body: dict[str, Any]) -> str:
    """What a client says it is in HELLO (name, pid), printable and short: only ever
    shown to people, next to what the kernel or the socket says (_operator)."""
    name = "".join(c for c in str(body.get("client", ""))[:32] if c.isprintable())
    pid = body.get("pid")
    return f"{name or 'client'} pid {pid}" if type(pid) is int else (name or "")


def _operator(conn: ClientConn) -> str:
    """Who ended a session, as far as the appliance knows (issue 16 §3): a Unix peer's
    pid and uid come from the kernel (SO_PEERCRED), with the user's name; a TCP peer is
    its address. What the client said in HELLO follows, marked as its own claim."""
    who = conn.peer
    m = re.search(r"uid=(\d+)", conn.peer) if conn.via_unix else None
    if m is not None:
        import pwd

        with contextlib.suppress(KeyError):
            who += f" user {pwd.getpwuid(int(m.group(1))).pw_name}"
    hello = conn.extra.get("hello")
    return f"{who}, says {hello}" if hello else who


def _raise_fd_limit() -> None:
    """Every client and session is a socket: take all the descriptors we may have."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def serve(cfg: Config, *, parent_pid: int | None = None, out=sys.stdout) -> int:
    sup = Supervisor(cfg, parent_pid=parent_pid)
    try:
        sup.setup()
    except DjinnError as exc:
        print(f"djinn serve: {exc}", file=sys.stderr)
        sup.shutdown()
        return EXIT_CONFIG
    if sup.wait_ready() == 0:
        errors = "; ".join(w.last_error for w in sup.workers if w.last_error)
        print(f"djinn serve: no worker started ({errors or 'see log above'})", file=sys.stderr)
        sup.shutdown()
        return EXIT_NO_WORKERS
    print(sup.readiness_line(), file=out, flush=True)
    sup.serve_forever()
    return EXIT_OK
