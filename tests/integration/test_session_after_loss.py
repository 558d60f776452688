"""Note [session after loss] (frontend/session.py): when the default session is lost (its
appliance restarted) or ended by an operator, the tensors it held raise their typed error
and the program's new tensors go to a new session instead of failing forever. By default
a lost session is first rebuilt on the restarted appliance (Note [lineage journal]), so
its tensors keep their values (issue 12 §5: the same policy as a worker's loss); with
recovery_retries = 0 an appliance restart costs one clear error per lost tensor."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

PROBE = textwrap.dedent("""
    import os, sys, tempfile
    from pathlib import Path
    sys.path.insert(0, {repo!r})
    import torch
    from tests.conftest import start_appliance

    tmp = Path(tempfile.mkdtemp())
    app = start_appliance(tmp / "a")
    os.environ["DJINN_ADDRESS"] = app.unix
    import djinn
    from djinn.frontend.session import default_session

    x = torch.ones(3, device="remote_accelerator:0") * 2
    print("before", x.cpu().tolist())
    if sys.argv[1] == "restart":
        app.stop()
        app = start_appliance(tmp / "a")  # the same socket path
    else:
        with app.connect() as admin:
            print("killed", admin.kill_session(default_session().id))
    for name, work in (("old", lambda: (x + 1).cpu()), ("read", lambda: x.cpu())):
        try:
            print(name, work().tolist())
        except Exception as exc:
            print(name, type(exc).__name__)
    y = torch.ones(3, device="remote_accelerator:0") * 3
    print("new", y.cpu().tolist())
    app.stop()
""")


def _probe(tmp_path: Path, how: str, **settings: str) -> list[str]:
    repo = str(Path(__file__).resolve().parents[2])
    script = tmp_path / "probe.py"
    script.write_text(PROBE.format(repo=repo))
    env = {k: v for k, v in os.environ.items() if not k.startswith("DJINN_")}
    env.update({f"DJINN_{k.upper()}": v for k, v in settings.items()})
    out = subprocess.run(
        [sys.executable, str(script), how], env=env, capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_after_an_appliance_restart_the_session_is_rebuilt_with_its_values(tmp_path):
    lines = _probe(tmp_path, "restart")
    assert lines == [
        "before [2.0, 2.0, 2.0]",
        "old [3.0, 3.0, 3.0]",
        "read [2.0, 2.0, 2.0]",
        "new [3.0, 3.0, 3.0]",
    ]


def test_without_recovery_after_a_restart_new_tensors_work_and_old_ones_say_why(tmp_path):
    lines = _probe(tmp_path, "restart", recovery_retries="0")
    assert lines[0] == "before [2.0, 2.0, 2.0]"
    assert lines[1:3] == ["old SessionLost", "read SessionLost"]
    assert lines[3] == "new [3.0, 3.0, 3.0]"


def test_after_an_operator_ends_the_session_new_tensors_get_a_new_one(tmp_path):
    lines = _probe(tmp_path, "kill")
    assert lines[:2] == ["before [2.0, 2.0, 2.0]", "killed True"]
    assert lines[2:4] == ["old SessionEnded", "read SessionEnded"]
    assert lines[4] == "new [3.0, 3.0, 3.0]"


def _arena_maps() -> list[str]:
    return [line for line in Path("/proc/self/maps").read_text().splitlines() if "djinn" in line]


def test_a_session_rebuilt_after_a_restart_lets_the_old_arena_go(tmp_path):
    """The old appliance's arena is unlinked when it stops, but its pages stay allocated
    while anyone maps them: the client kept its mapping of every arena it had seen."""
    import torch

    from djinn.runtime.client import connect
    from tests.conftest import start_appliance

    app = start_appliance(tmp_path / "a")
    try:
        with connect(app.unix) as client, client.session(recover=True) as session:
            kept = session.put(torch.ones(1 << 20))  # 4 MiB: through the arena
            old = session.arena.name
            assert any(old.lstrip("/") in line for line in _arena_maps())
            app.stop()
            app = start_appliance(tmp_path / "a")  # the same socket path
            assert torch.equal(session.get(kept), torch.ones(1 << 20))  # rebuilt, replayed
            assert session.arena.name != old
            maps = _arena_maps()
            assert not any(old.lstrip("/") in line for line in maps), maps
            assert any(session.arena.name.lstrip("/") in line for line in maps), maps
    finally:
        app.stop()
