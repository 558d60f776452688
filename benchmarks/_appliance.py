"""The transport benchmark's private appliance: ``djinn serve`` with its own config in a
temporary directory, its readiness line parsed for the addresses, and a stop (SIGTERM,
then kill) on every way out, SIGTERM to the benchmark included."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from _common import note

if TYPE_CHECKING:
    from djinn.runtime.client import Client

READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0


@dataclass
class Appliance:
    proc: subprocess.Popen[str]
    unix: str
    tcp: str
    token: str
    readiness: str
    log_path: Path

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return self.proc.returncode

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string


@contextlib.contextmanager
def appliance(
    workdir: Path, arena_bytes: int, gpus: str, *, warm: bool = True, **extra: object
) -> Iterator[Appliance]:
    """``djinn serve`` with a private socket, an ephemeral TCP port and a fresh token
    (and ``extra`` settings), its workers warm unless ``warm=False`` (a benchmark of
    what a user pays the moment the appliance is up); stopped with SIGTERM on the way
    out, whatever happens."""
    token = "bench-" + secrets.token_hex(16)
    settings: dict[str, object] = {
        "socket_path": str(workdir / "djinn.sock"),
        "tcp_enabled": True,
        "tcp_host": "127.0.0.1",
        "tcp_port": 0,
        "token": token,
        "arena_bytes": arena_bytes,
        "gpus": gpus,
        # A 1 GiB TCP frame can keep a request in flight for seconds: a generous lease.
        "heartbeat_interval": 1.0,
        "heartbeat_misses": 30,
        "log_level": "warning",
        **extra,
    }
    config = workdir / "djinn.toml"
    config.write_text("".join(f"{k} = {toml_value(v)}\n" for k, v in settings.items()))
    log_path = workdir / "serve.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DJINN_")}
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "djinn.cli.main", "serve", "--config", str(config)],
            stdout=subprocess.PIPE,
            stderr=log,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env,
            cwd=workdir,
        )
    app = Appliance(proc, "", "", token, "", log_path)
    try:
        line = wait_ready(proc)
        unix = re.search(r"\bunix=(\S+)", line)
        tcp = re.search(r"\btcp=(\S+)", line)
        if unix is None or tcp is None:
            raise RuntimeError(f"unexpected readiness line: {line!r}")
        app.unix, app.tcp, app.readiness = f"unix://{unix[1]}", f"tcp://{tcp[1]}", line
        # Note [prewarm]: a worker imports model code in the background after it is ready;
        # nothing is timed while that import takes the CPU (it made tiny round trips 5x
        # slower in transport.py, which did not wait)
        if warm:
            wait_warm(app)
        yield app
    except BaseException:
        tail = app.log_tail()
        if tail:
            note(f"appliance log (last lines):\n{tail}")
        raise
    finally:
        code = app.stop()
        note(f"appliance stopped (exit {code})")


def wait_ready(proc: subprocess.Popen[str]) -> str:
    from djinn.runtime.embedded import readiness

    line = readiness(proc, READY_TIMEOUT_S)
    if line is None:
        raise RuntimeError(f"djinn serve did not become ready (exit code {proc.poll()})")
    return line


def device_of(readiness: str) -> str:
    """The device named in brackets on the readiness line, or ``?``."""
    device = re.search(r"\[(.*)\]", readiness)
    return device[1] if device else "?"


def connect(app: Appliance, transport: str) -> Client:
    from djinn.runtime.client import Client

    # Client directly, not djinn.connect: no config lookup, no embedded fallback.
    return Client(app.unix) if transport == "unix" else Client(app.tcp, app.token)


def unwind_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit, so that ``appliance()`` unwinds and stops the server."""

    def on_sigterm(signum: int, _frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)  # unwind, so the appliance is stopped

    signal.signal(signal.SIGTERM, on_sigterm)


def wait_warm(app: Appliance, timeout: float = 120.0) -> None:
    """Wait until every worker has imported its model code (Note [prewarm]): a benchmark
    of a warm appliance must not time the background import's share of the CPU."""
    from djinn.runtime.client import Client

    deadline = time.monotonic() + timeout
    with Client(app.unix) as client:
        while time.monotonic() < deadline:
            states = [w.get("prewarm") for w in client.stats()["workers"]]
            if states and all(s in ("done", "off", "failed") for s in states):
                return
            time.sleep(0.1)
    note(f"workers still importing model code after {timeout:.0f} s; measuring anyway")
