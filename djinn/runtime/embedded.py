"""The embedded appliance: a private `djinn serve` child for a process with no address.

It listens only on a Unix socket in a fresh private directory (no TCP), watches its
parent's pid so it cannot outlive the program, and is stopped at interpreter exit.
"""

from __future__ import annotations

import atexit
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from djinn.errors import Unavailable

_lock = threading.Lock()
_embedded: EmbeddedAppliance | None = None


class EmbeddedAppliance:
    def __init__(self, timeout: float, config_path: str | None = None) -> None:
        self.dir = tempfile.mkdtemp(prefix="djinn-embedded-")
        os.chmod(self.dir, 0o700)
        self.socket_path = os.path.join(self.dir, "djinn.sock")
        env = dict(os.environ)
        env.update(DJINN_SOCKET_PATH=self.socket_path, DJINN_TCP_ENABLED="false")
        cmd = [sys.executable, "-m", "djinn.cli.main", "serve", "--parent-pid", str(os.getpid())]
        if config_path:
            cmd += ["--config", config_path]
        self.proc = subprocess.Popen(
            cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True
        )
        self.owner = os.getpid()
        self.readiness = self._wait_ready(timeout)
        atexit.register(self.stop)

    def _wait_ready(self, timeout: float) -> str:
        line = readiness(self.proc, timeout)
        if line is None:
            self.stop()
            raise Unavailable("the embedded appliance did not start (see its messages above)")
        return line

    @property
    def address(self) -> str:
        return f"unix://{self.socket_path}"

    def stop(self) -> None:
        if os.getpid() != self.owner:
            # a forked child's exit (Note [a forked process] in channel.py): the appliance
            # is its parent's, which goes on using it
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:  # its readiness pipe (a ResourceWarning at exit)
            self.proc.stdout.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def embedded_address(timeout: float, config_path: str | None = None) -> str:
    """Address of this process's embedded appliance, starting it on first use."""
    global _embedded
    with _lock:
        if _embedded is None or _embedded.proc.poll() is not None:
            _embedded = EmbeddedAppliance(timeout, config_path)
        return _embedded.address


def readiness(proc: subprocess.Popen[str], timeout: float) -> str | None:
    """The readiness line a starting `djinn serve` prints on its stdout, or None if it
    exits or stays silent for ``timeout`` seconds."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.2)
        if ready:
            line = proc.stdout.readline()
            if line.startswith("djinn ready"):
                return line.strip()
        if proc.poll() is not None:
            break
    return None
