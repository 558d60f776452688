"""The supervisor's view of its workers: starting them, noticing death, restart back-off."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from . import control

log = logging.getLogger("djinn.appliance.workers")

FIRST_BACKOFF_S = 0.5


# Note [idle OpenMP threads]: between two parallel regions a worker's OpenMP threads wait
# for the next one, by default (libgomp, which PyTorch's wheels use) spinning 300,000
# rounds before they sleep. A client on the same host captures its next graph while the
# worker runs the last one (Note [asynchronous flushes]), and on a host with few cores
# the spinning threads took its core each time the worker paused between ops or graphs:
# on 2 cores a 20-step training loop (benchmarks/training_step.py) took 0.83 s with the
# runtime's own wait, 0.58 s with a thousand rounds, 0.57 s sleeping at once. Sleeping at
# once costs a wake-up per parallel region instead: "brief" is the default.
# What brief costs (stop 50, a faster 2-core VM, nothing else running): a kernel-bound
# forward whose client waits idle pays a wake-up at each region. A replayed GPT-2
# forward (12 layers, 64 tokens) ran 1.02-1.03x local eager with the runtime's own wait,
# 1.06-1.08x at 30,000 rounds, 1.09-1.13x brief; captured, 1.10x against 1.17-1.18x.
# What it saves, the same hour: the captured 20-step loop 5-20% (its replays alike), and
# four of the suite's integration files (training, parity, streamed graphs: appliances
# and clients sharing the 2 cores) ran in 18-19 s brief against 27-30 s with the
# runtime's own wait. A host whose worker has its cores to itself can set "inherit".
# (Stop 41's alternated capture.py runs read the forward's replay over local eager 1.055
# and 1.036 brief, 1.043 and 1.022 with the runtime's own.)
# It changes when threads wait, never how an op's work is split among them, so
# the results are the same bits. The runtime reads these variables once, when it loads.
_WAITS = {
    "brief": {"GOMP_SPINCOUNT": "1000"},
    "passive": {"GOMP_SPINCOUNT": "0"},
    "active": {"OMP_WAIT_POLICY": "ACTIVE"},
}


def _set_wait_policy(policy: str, env: dict[str, str]) -> None:
    """The worker's environment for ``cpu_wait_policy`` (Note [idle OpenMP threads]), over
    the supervisor's; "inherit" keeps the supervisor's."""
    if policy != "inherit":
        env.pop("GOMP_SPINCOUNT", None)
        env.pop("OMP_WAIT_POLICY", None)
        env.update(_WAITS[policy])


@dataclass
class WorkerHandle:
    id: int
    device: str
    init: dict[str, Any]
    proc: subprocess.Popen | None = None
    ctl: socket.socket | None = None
    ready: bool = False
    alive: bool = False
    restarts: int = 0
    quick_crashes: int = 0  # deaths since it was last healthy (Note [crash-loop back-off])
    backoff_s: float = 0.0  # the wait before the current restart
    started_at: float = 0.0
    ready_at: float | None = None  # when it last reported ready (None: not since start)
    restart_at: float | None = None
    device_name: str = ""
    pid: int | None = None
    last_error: str = ""
    stats: dict[str, Any] = field(default_factory=dict)
    stats_parts: list[list[dict[str, Any]]] = field(default_factory=list)
    stats_at: float | None = None  # when the last full report arrived (monotonic)
    # Sessions handed over but not yet in a report, by id: (hand-over number, peer, when).
    # A busy worker reads its control channel only after the request it is running.
    opening: dict[str, tuple[int, str, float]] = field(default_factory=dict)
    handed: int = 0  # sessions handed to this process; the worker counts them as "adopted"

    def start(self) -> None:
        parent, child = control.pair()
        env = dict(os.environ)
        env["DJINN_APPLIANCE_PROCESS"] = "1"  # no client-side device hooks in a worker
        # a worker never fetches code or weights from a hub, whatever a request says
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        _set_wait_policy(self.init.get("cpu_wait_policy", "inherit"), env)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "djinn.appliance.worker", "--control-fd", str(child.fileno())],
            pass_fds=[child.fileno()],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=sys.stderr.fileno(),  # stdout is the supervisor's: readiness line only
        )
        child.close()
        self.ctl = parent
        self.pid = self.proc.pid
        self.alive = True
        self.ready = False
        self.started_at = time.monotonic()
        self.ready_at = None
        self.restart_at = None
        self.stats = {}
        self.stats_parts = []
        self.stats_at = None
        self.opening.clear()
        self.handed = 0
        control.send(parent, self.init)

    def mark_dead(self, backoff_max: float, reset_after: float = 60.0) -> None:
        """Record the death and schedule a replacement.

        Note [crash-loop back-off]: each death of a worker that had not yet been healthy
        (ready) for ``reset_after`` seconds doubles the wait before the next start, up to
        ``backoff_max``; a worker that *was* healthy that long is forgiven its history,
        and its replacement starts after the first, short wait. Without the reset, a
        worker killed now and then (a bad request every half minute) climbed to the
        maximum wait and stayed there."""
        if not self.alive:
            return
        self.alive = False
        self.ready = False
        if self.proc is not None:
            with contextlib.suppress(OSError):
                self.proc.kill()
            code = self.proc.wait()
            lost = " (its GPU context was lost)" if code == control.DEVICE_LOST_EXIT else ""
            self.last_error = self.last_error or f"exit code {code}{lost}"
        if self.ctl is not None:
            self.ctl.close()
            self.ctl = None
        now = time.monotonic()
        healthy = self.ready_at is not None and now - self.ready_at >= reset_after
        self.quick_crashes = 1 if healthy else self.quick_crashes + 1
        self.backoff_s = min(backoff_max, FIRST_BACKOFF_S * 2 ** (self.quick_crashes - 1))
        self.restart_at = now + self.backoff_s
        self.stats = {}
        self.opening.clear()  # those sessions died with it (their clients see SESSION_LOST)
        log.warning(
            "worker %d (%s) died (%s) after %.1fs; restarting in %.1fs",
            self.id,
            self.device,
            self.last_error,
            now - self.started_at,
            self.backoff_s,
        )

    def handed_over(self, session: str, peer: str) -> None:
        self.handed += 1
        self.opening[session] = (self.handed, peer, time.monotonic())

    def reported(self, msg: dict[str, Any]) -> None:
        """A full stats report arrived: sessions it has adopted are no longer opening."""
        self.stats = msg
        self.stats_at = time.monotonic()
        adopted = int(msg.get("adopted", 0))
        for sid in [sid for sid, (n, _, _) in self.opening.items() if n <= adopted]:
            del self.opening[sid]

    def session_count(self) -> int:
        return len(self.stats.get("sessions", [])) + len(self.opening)

    def describe(self) -> dict[str, Any]:
        now = time.monotonic()
        util = self.stats.get("utilisation") or {}
        return {
            "id": self.id,
            "device": self.device_name or self.device,
            "pid": self.pid,
            "alive": self.alive,
            "ready": self.ready,
            "restarts": self.restarts,
            "backoff_s": self.backoff_s,
            "sessions": self.session_count(),
            "prewarm": self.stats.get("prewarm", ""),  # Note [prewarm]: model code imported
            "uptime_s": round(time.monotonic() - self.started_at, 3) if self.alive else 0.0,
            "last_error": self.last_error,
            # Note [busy stats] (busy.py): what a busy worker runs, and how old its report is
            "busy": self.stats.get("busy"),
            "stats_age_s": None if self.stats_at is None else round(now - self.stats_at, 3),
            # Note [spin before sleeping]: its window, waits that polled, and those of them
            # whose request came while it polled
            "spin": self.stats.get("spin"),
            "utilisation": util.get("percent"),
            "utilisation_source": util.get("source"),
            # a GPU's memory as NVML sees it (every process on the card), and as this
            # worker's CUDA allocator holds it (Note [device memory figures], device.py)
            "gpu_memory_used": util.get("memory_used"),
            "gpu_memory_total": util.get("memory_total"),
            "device_memory": self.stats.get("device_memory"),
        }
