"""Note [frozen program] (djinn/frontend/session.py): when a client's first default session
opens, what exists then is frozen out of Python's collector; what the program makes later
is collected as before. ``client_gc_freeze = false`` leaves the collector alone."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent(
    """
    import gc, weakref
    import torch
    import djinn  # noqa: F401

    class Cycle:
        def __init__(self):
            self.me = self

    early = Cycle()
    early_ref = weakref.ref(early)
    before = gc.get_freeze_count()
    x = torch.ones(3).to("remote_accelerator:0")
    print("value", (x + 1).cpu().tolist())
    frozen = gc.get_freeze_count()
    late = Cycle()
    late_ref = weakref.ref(late)
    del early, late
    gc.collect()
    print("freeze", before, frozen)
    print("collected", early_ref() is None, late_ref() is None)
    """
)


def _probe(address: str, **env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DJINN_")}
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        env={**clean, "DJINN_ADDRESS": address, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


@pytest.mark.parametrize("setting", ["true", "false"])
def test_the_first_session_freezes_what_exists_then_and_later_objects_are_collected(
    appliance, setting
):
    lines = _probe(appliance.unix, DJINN_CLIENT_GC_FREEZE=setting)
    assert lines[0] == "value [2.0, 2.0, 2.0]"
    before, frozen = (int(n) for n in lines[1].split()[1:])
    early_collected, late_collected = lines[2].split()[1:]
    assert before == 0
    assert late_collected == "True"  # made after the session opened: collected as before
    if setting == "true":
        assert frozen > 10_000  # the imported modules, among others
        assert early_collected == "False"  # the documented cost: a frozen cycle stays
    else:
        assert frozen == 0 and early_collected == "True"
