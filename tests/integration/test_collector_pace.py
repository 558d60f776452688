"""Note [collector pace] (djinn/frontend/session.py): when a client's first default session
opens, Python's young-generation threshold is raised to ``client_gc_threshold`` (never
lowered); nothing is exempted from collection, before or after."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent(
    """
    import gc, sys, weakref
    import torch
    import djinn  # noqa: F401

    if sys.argv[1] != "-":
        gc.set_threshold(int(sys.argv[1]))

    class Cycle:
        def __init__(self):
            self.me = self

    early = Cycle()
    early_ref = weakref.ref(early)
    before = gc.get_threshold()[0]
    x = torch.ones(3).to("remote_accelerator:0")
    print("value", (x + 1).cpu().tolist())
    after = gc.get_threshold()[0]
    late = Cycle()
    late_ref = weakref.ref(late)
    del early, late
    gc.collect()
    print("threshold", before, after, gc.get_freeze_count())
    print("collected", early_ref() is None, late_ref() is None)
    """
)


def _probe(address: str, own: str, **env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DJINN_")}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, own],
        env={**clean, "DJINN_ADDRESS": address, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


@pytest.mark.parametrize(
    ("setting", "own", "want"),
    [
        ("10000", "-", 10_000),  # CPython's 700 raised
        ("0", "-", 700),  # left as it is
        ("10000", "50000", 50_000),  # the program's own, higher: kept
    ],
)
def test_the_first_session_paces_the_collector_and_nothing_escapes_it(
    appliance, setting, own, want
):
    lines = _probe(appliance.unix, own, DJINN_CLIENT_GC_THRESHOLD=setting)
    assert lines[0] == "value [2.0, 2.0, 2.0]"
    before, after, frozen = (int(n) for n in lines[1].split()[1:])
    assert before == (700 if own == "-" else int(own))
    assert after == want and frozen == 0
    assert lines[2] == "collected True True"  # cycles made before and after: collected
