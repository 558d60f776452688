"""What an operator sees and what a client is told (issue 16 §1, §3, §7): the stats
document while a worker is busy, `djinn status` then, and a session ended by an operator."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import djinn
from djinn.appliance import stats
from djinn.cli.status import render
from tests.conftest import wait_for

# A client that runs long op graphs (a chain of 1000x1000 matmuls, about a second each
# on these machines) one after another until the file named in argv[1] exists.
BUSY_CLIENT = textwrap.dedent("""
    import os, sys, torch, djinn
    x = torch.randn(1000, 1000, device="remote_accelerator:0")
    print("running", flush=True)
    while not os.path.exists(sys.argv[1]):
        y = x
        for _ in range(24):
            y = torch.tanh(y @ x)
        y.sum().item()
""")


def _busy_client(app, stop_file) -> subprocess.Popen:
    env = {**os.environ, "DJINN_ADDRESS": app.unix}
    proc = subprocess.Popen(
        [sys.executable, "-c", BUSY_CLIENT, str(stop_file)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout.readline().strip() == "running"
    return proc


def _open_one(app) -> bool:
    with app.connect() as client, client.session() as s:
        return bool(s.id)


def test_a_busy_worker_keeps_reporting_what_it_runs_and_status_shows_it(fresh_appliance, tmp_path):
    app = fresh_appliance()
    stop = tmp_path / "stop"
    proc = _busy_client(app, stop)
    try:
        busy = wait_for(lambda: app.stats()["workers"][0]["busy"], timeout=60)
        assert busy["kind"] == "EXEC"
        # the running session's own row keeps being reported while its request runs
        doc = wait_for(
            lambda: (
                (d := app.stats())["workers"][0]["busy"]
                and d["workers"][0]["busy"]["for_s"] > 0.2
                and d
            ),
            timeout=60,
        )
        rows = {s["id"]: s for s in doc["sessions"]}
        assert doc["workers"][0]["busy"]["session"] in rows
        text = render(doc)
        assert "busy" in text and "EXEC" in text and "phase" in text
        # the command itself, while the worker is busy
        done = subprocess.run(
            [sys.executable, "-m", "djinn.cli.main", "status", "--address", app.unix],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        assert "Sessions" in done.stdout and "phase" in done.stdout
        # the repro: a second client connects while the worker is busy; every
        # document read meanwhile has whole session rows and renders
        opened: list = []
        opener = threading.Thread(target=lambda: opened.append(_open_one(app)), daemon=True)
        opener.start()
        while opener.is_alive():
            doc = app.stats()
            for row in doc["sessions"]:
                assert row.keys() >= stats.opening_row("x", "y").keys(), row
            assert "Sessions" in render(doc)
            opener.join(0.05)
        assert opened == [True]
        # §7: the worker measures its own utilisation and says how
        worker = wait_for(lambda: (w := app.stats()["workers"][0])["utilisation"] and w, timeout=30)
        assert worker["utilisation_source"] == "process_cpu"
        assert 0 < worker["utilisation"] <= 100
    finally:
        stop.touch()
        proc.wait(60)


KILLED_CLIENT = textwrap.dedent("""
    import sys, torch, djinn
    c = djinn.connect(sys.argv[1])
    s = c.session()
    keep = s.put(torch.randn(512, 512))
    print(s.id, flush=True)
    for line in sys.stdin:  # each line: one call, then what happened
        try:
            keep.cpu()
            print("ok", flush=True)
        except djinn.DjinnError as exc:
            print(exc.code, exc.message.replace("\\n", " "), flush=True)
""")


def test_a_session_ended_by_an_operator_is_told_who_and_when(fresh_appliance):
    app = fresh_appliance()
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_CLIENT, app.unix],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        sid = proc.stdout.readline().strip()
        wait_for(lambda: sid in {s["id"] for s in app.stats()["sessions"]})
        with djinn.connect(app.unix) as operator:
            assert operator.kill_session(sid)
        wait_for(lambda: sid not in {s["id"] for s in app.stats()["sessions"]})
        for _ in range(2):  # and again: the tombstone keeps telling the truth
            proc.stdin.write("call\n")
            proc.stdin.flush()
            code, _, message = proc.stdout.readline().strip().partition(" ")
            assert code == "SESSION_ENDED", message
            assert "ended by an operator" in message
            assert f"unix:pid={os.getpid()}" in message  # who: the operator's connection
            assert "says djinn-python" in message  # and what its client said it was
            assert "UTC" in message  # when
        assert "ended by operator" in app.log()
    finally:
        proc.stdin.close()
        proc.wait(30)
