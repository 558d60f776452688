"""One appliance of a fleet: a Ray actor that runs `djinn serve` on its node.

The actor is a thin keeper. It starts `djinn serve` as a child process (the supervisor
forks workers and installs signal handlers, so it needs a process of its own, not a
Ray worker thread), with ``--parent-pid`` so the appliance stops when the actor dies:
a node that Ray loses takes its appliance with it. It answers the directory's polls with
a summary of the appliance's stats document (``summary.py``), read over the appliance's
Unix socket. Clients never talk to the actor: they connect to the endpoint it reports.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from .summary import summarize

# Settings the actor decides itself: where the appliance listens, with which token, and
# which GPUs it serves (those Ray granted it, never the head's list).
OWN_SETTINGS = frozenset(
    {"address", "socket_path", "tcp_enabled", "tcp_host", "tcp_port", "token", "token_file"}
    | {"gpus"}
)
STOP_TIMEOUT_S = 15.0
DIR_PREFIX = "djinn-fleet-"
LOG_TAIL_BYTES = 2000


def _env_value(value: Any) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


class ApplianceActor:
    def __init__(
        self,
        appliance_id: str,
        settings: dict[str, Any],
        token: str,
        bind_host: str = "",
        start_timeout: float = 60.0,
    ) -> None:
        import ray

        self.id = appliance_id
        self._client: Any = None
        ctx = ray.get_runtime_context()
        self.node_id = ctx.get_node_id()
        self.node_ip = ray.util.get_node_ip_address()
        sweep_leftovers()
        self.dir = Path(tempfile.mkdtemp(prefix=DIR_PREFIX + f"{appliance_id}-"))
        self.socket_path = str(self.dir / "djinn.sock")
        env = {k: v for k, v in os.environ.items() if not k.startswith("DJINN_")}
        # Ray narrows CUDA_VISIBLE_DEVICES and sets OMP_NUM_THREADS=1 for an actor that
        # reserves no CPUs; the appliance counts GPUs with NVML (physical indices) and
        # sizes its own threads, so it gets the physical ids Ray granted and no cap.
        env.pop("CUDA_VISIBLE_DEVICES", None)
        env.pop("OMP_NUM_THREADS", None)
        for key, value in settings.items():
            if key not in OWN_SETTINGS:
                env["DJINN_" + key.upper()] = _env_value(value)
        gpu_ids = [str(int(g)) for g in ray.get_gpu_ids()]
        env["DJINN_GPUS"] = ",".join(gpu_ids) if gpu_ids else "none"
        self.host = bind_host or self.node_ip
        env.update(
            DJINN_SOCKET_PATH=self.socket_path,
            DJINN_TCP_ENABLED="true",
            DJINN_TCP_HOST=self.host,
            DJINN_TCP_PORT="0",
            DJINN_TOKEN=token,
        )
        self.log_path = self.dir / "serve.log"
        cmd = [sys.executable, "-m", "djinn.cli.main", "serve", "--parent-pid", str(os.getpid())]
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self.log_path.open("w"),
            text=True,
        )
        (self.dir / "actor.pid").write_text(str(os.getpid()))
        self.readiness = self._wait_ready(start_timeout)
        m = re.search(r"tcp=\S*:(\d+)", self.readiness)
        if not m:
            self.stop()
            raise RuntimeError(f"appliance {self.id} listens on no TCP port: {self.readiness}")
        advertised = self.node_ip if self.host in ("0.0.0.0", "::") else self.host
        self.endpoint = f"tcp://{advertised}:{m.group(1)}"

    def _wait_ready(self, timeout: float) -> str:
        from djinn.runtime.embedded import readiness

        line = readiness(self.proc, timeout)
        if line is None:
            self.stop()
            raise RuntimeError(f"appliance {self.id} did not start: {self._log_tail()}")
        return line

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-LOG_TAIL_BYTES:]
        except OSError:
            return "(no log)"

    def info(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "node_id": self.node_id,
            "node_ip": self.node_ip,
            "endpoint": self.endpoint,
            "pid": self.proc.pid,
            "readiness": self.readiness,
        }

    def summary(self) -> dict[str, Any]:
        """The appliance's stats, reduced; raises if `djinn serve` is gone (the directory
        then retires this actor and starts a new one on the node)."""
        from djinn.errors import DjinnError
        from djinn.runtime.client import Client

        code = self.proc.poll()
        if code is not None:
            raise RuntimeError(f"djinn serve exited with code {code}: {self._log_tail()}")
        try:
            if self._client is None:
                self._client = Client(f"unix://{self.socket_path}")
            doc = self._client.stats()
        except DjinnError:
            if self._client is not None:
                self._client.close()
            self._client = None
            raise
        return summarize(doc)

    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        if self._client is not None:
            self._client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def sweep_leftovers() -> None:
    """Remove the working directories (socket, log) of appliance actors on this host that
    are gone: an actor Ray killed (its node lost, the fleet stopped hard) never ran stop()."""
    for d in Path(tempfile.gettempdir()).glob(DIR_PREFIX + "*"):
        try:
            pid = int((d / "actor.pid").read_text())
        except (OSError, ValueError):
            continue  # not ours, or still starting
        if not _alive(pid):
            shutil.rmtree(d, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
