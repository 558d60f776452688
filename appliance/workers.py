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

QUICK_CRASH_S = 10.0  # a worker dying sooner than this counts towards crash-loop back-off
FIRST_BACKOFF_S = 0.5


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
    quick_crashes: int = 0
    started_at: float = 0.0
    restart_at: float | None = None
    device_name: str = ""
    pid: int | None = None
    last_error: str = ""
    stats: dict[str, Any] = field(default_factory=dict)
    stats_parts: list[list[dict[str, Any]]] = field(default_factory=list)

    def start(self) -> None:
        parent, child = control.pair()
        env = dict(os.environ)
        env["DJINN_APPLIANCE_PROCESS"] = "1"  # no client-side device hooks in a worker
        # a worker never fetches code or weights from a hub, whatever a request says
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
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
        self.restart_at = None
        self.stats = {}
        self.stats_parts = []
        control.send(parent, self.init)

    def mark_dead(self, backoff_max: float) -> None:
        """Record the death and schedule a replacement (doubling the wait on crash loops)."""
        if not self.alive:
            return
        self.alive = False
        self.ready = False
        if self.proc is not None:
            with contextlib.suppress(OSError):
                self.proc.kill()
            code = self.proc.wait()
            self.last_error = self.last_error or f"exit code {code}"
        if self.ctl is not None:
            self.ctl.close()
            self.ctl = None
        lived = time.monotonic() - self.started_at
        self.quick_crashes = self.quick_crashes + 1 if lived < QUICK_CRASH_S else 0
        delay = min(backoff_max, FIRST_BACKOFF_S * 2 ** max(0, self.quick_crashes - 1))
        self.restart_at = time.monotonic() + delay
        self.stats = {}
        log.warning(
            "worker %d (%s) died (%s) after %.1fs; restarting in %.1fs",
            self.id,
            self.device,
            self.last_error,
            lived,
            delay,
        )

    def session_count(self) -> int:
        return len(self.stats.get("sessions", []))

    def describe(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "device": self.device_name or self.device,
            "pid": self.pid,
            "alive": self.alive,
            "ready": self.ready,
            "restarts": self.restarts,
            "sessions": self.session_count(),
            "uptime_s": round(time.monotonic() - self.started_at, 3) if self.alive else 0.0,
            "last_error": self.last_error,
        }
