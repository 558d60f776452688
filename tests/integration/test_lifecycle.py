"""Start-up, shutdown and leftovers: `djinn serve` cleans up after itself and others."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import posix_ipc
import torch

from djinn.appliance.vmu.arena import boot_id
from tests.conftest import start_appliance


def _segments_of(pid: int) -> list[str]:
    return [p.name for p in Path("/dev/shm").glob(f"djinn-*-{pid}-*")]


def test_sigterm_drains_and_leaves_no_shared_memory(fresh_appliance):
    app = fresh_appliance()
    with app.connect() as client, client.session() as s:
        s.put(torch.randn(1024, 1024))
    assert _segments_of(app.proc.pid)
    assert app.stop(signal.SIGTERM) == 0
    assert _segments_of(app.proc.pid) == []
    assert not os.path.exists(app.socket_path)


def test_sigterm_with_a_connected_client_still_exits_zero(fresh_appliance):
    app = fresh_appliance()
    client = app.connect()
    s = client.session()
    s.put(torch.randn(512, 512))
    assert app.stop(signal.SIGTERM) == 0
    assert _segments_of(app.proc.pid) == []
    client.close()


def test_start_up_sweeps_segments_left_by_a_crashed_appliance(tmp_path):
    dead_pid = 4_000_000  # above pid_max: never a live process
    name = f"/djinn-{boot_id()}-{dead_pid}-arena"
    seg = posix_ipc.SharedMemory(name, flags=posix_ipc.O_CREX, size=4096)
    seg.close_fd()
    app = start_appliance(tmp_path)
    try:
        # (which process swept it is not asserted: any appliance starting on this host,
        # a concurrent test's included, sweeps dead owners' segments)
        assert not Path("/dev/shm", name[1:]).exists()
    finally:
        app.stop()


def test_an_arena_that_does_not_fit_is_a_clear_error(tmp_path):
    cfg = tmp_path / "djinn.toml"
    cfg.write_text(
        f'socket_path = "{tmp_path}/s.sock"\ntcp_enabled = false\narena_bytes = "64TiB"\n'
    )
    out = subprocess.run(
        [sys.executable, "-m", "djinn.cli.main", "serve", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "RESOURCE_EXHAUSTED" in out.stderr and "arena" in out.stderr
    assert not list(Path("/dev/shm").glob(f"djinn-*-{os.getpid()}-*"))


def test_a_second_appliance_on_the_same_socket_is_refused(appliance, tmp_path):
    cfg = tmp_path / "djinn.toml"
    cfg.write_text(f'socket_path = "{appliance.socket_path}"\ntcp_enabled = false\n')
    out = subprocess.run(
        [sys.executable, "-m", "djinn.cli.main", "serve", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "already listening" in out.stderr


def test_tcp_without_any_token_creates_a_private_token_file(tmp_path):
    token_file = tmp_path / "secrets" / "token"
    app = start_appliance(tmp_path / "a", token="", token_file=str(token_file))
    try:
        assert token_file.stat().st_mode & 0o777 == 0o600
        import djinn

        with djinn.connect(app.tcp, token=token_file.read_text().strip()) as c:
            assert c.stats()["workers"]
    finally:
        app.stop()


def test_status_prints_a_table_and_json(appliance):
    env = {**os.environ, "DJINN_ADDRESS": appliance.unix}
    text = subprocess.run(
        [sys.executable, "-m", "djinn.cli.main", "status"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert text.returncode == 0, text.stderr
    for word in ("Workers", "Sessions", "host arena", "stack"):
        assert word in text.stdout
    raw = subprocess.run(
        [sys.executable, "-m", "djinn.cli.main", "status", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    doc = json.loads(raw.stdout)
    assert set(doc) >= {"workers", "sessions", "vmu", "models", "appliance"}
    w = doc["workers"][0]
    assert set(w) >= {"id", "device", "pid", "alive", "restarts"}
    for seg in ("text", "data", "stack"):
        assert set(doc["vmu"]["devices"][0][seg]) == {"capacity", "used", "peak"}
    assert doc["vmu"]["host_arena"]["capacity"] > 0


def test_status_over_tcp_and_client_stats_are_the_same_document(appliance):
    import djinn

    with djinn.connect(appliance.tcp, token=appliance.token) as c:
        api = c.stats()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "djinn.cli.main",
            "status",
            "--json",
            "--address",
            appliance.tcp,
            "--token",
            appliance.token,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    cli = json.loads(out.stdout)
    assert set(api) == set(cli)
    assert [w["pid"] for w in api["workers"]] == [w["pid"] for w in cli["workers"]]


def test_status_without_an_appliance_is_a_clear_error(tmp_path):
    env = {**os.environ, "DJINN_ADDRESS": f"unix://{tmp_path}/nothing.sock"}
    out = subprocess.run(
        [sys.executable, "-m", "djinn.cli.main", "status"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and "UNAVAILABLE" in out.stderr


def test_connect_with_no_address_starts_and_stops_an_embedded_appliance(tmp_path):
    code = textwrap.dedent("""
        import os, torch, djinn
        client = djinn.connect()
        with client.session() as s:
            t = torch.randn(300, 300)
            assert torch.equal(s.put(t).cpu(), t)
        st = client.stats()
        print(st["appliance"]["pid"], st["appliance"]["addresses"]["unix"], flush=True)
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DJINN_")}
    env["DJINN_SOCKET_PATH"] = str(tmp_path / "nobody-listens.sock")
    env["DJINN_ARENA_BYTES"] = "64MiB"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    pid, address = out.stdout.split()
    assert "djinn-embedded-" in address
    # stopped with the client process: no process, no segment, no socket directory
    assert (
        not Path(f"/proc/{pid}").exists()
        or b"djinn" not in Path(f"/proc/{pid}/cmdline").read_bytes()
    )
    assert _segments_of(int(pid)) == []
    assert not Path(address.removeprefix("unix://")).parent.exists()


def test_embedded_appliance_stops_when_its_client_is_killed(tmp_path):
    code = textwrap.dedent("""
        import sys, time, djinn
        c = djinn.connect()
        st = c.stats()["appliance"]
        print(st["pid"], st["addresses"]["unix"], flush=True)
        time.sleep(120)
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DJINN_")}
    env["DJINN_SOCKET_PATH"] = str(tmp_path / "nobody-listens.sock")
    env["DJINN_ARENA_BYTES"] = "64MiB"
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True
    )
    pid, address = proc.stdout.readline().split()
    pid = int(pid)
    proc.kill()
    proc.wait()
    from tests.conftest import wait_for

    def gone() -> bool:
        try:
            return b"djinn" not in Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return True

    wait_for(gone, timeout=15)
    assert _segments_of(pid) == []
    # the client's atexit never ran: the appliance removed its private directory itself
    assert not Path(address.removeprefix("unix://")).parent.exists()
