"""PyTorch's OpInfo database through LazyTensor, float32, every op: at least ``FLOOR`` of
the ops match eager, none is wrong, every failure is a typed DjinnError.

Runs ``benchmarks/opinfo_coverage.py`` itself (which prints the full report for five
dtypes) against the shared appliance, float32 only and two samples per op to stay quick.
Which samples count comes from an eager reference the script computes first, in a
subprocess that never imported djinn: an op is skipped only when eager refuses it there
(issue 8 §4). Nothing of djinn's internal state is reset between samples or ops. It runs
as a subprocess because both processes must share a pinned ``PYTHONHASHSEED`` (Note
[deterministic samples] in ``benchmarks/opinfo_reference.py``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
MAX_SAMPLES = 2
# measured with 2 samples per op, torch 2.13 CPU: 655-657 of 672 (97.5-97.8 %) while the
# appliance's allowlist was being written; a few points below that, never below the 85 %
# this test started at
FLOOR = 0.95


@pytest.fixture(scope="module")
def report(appliance, tmp_path_factory):
    out = tmp_path_factory.mktemp("opinfo") / "coverage.json"
    cmd = [sys.executable, str(BENCHMARKS / "opinfo_coverage.py"), "--dtypes", "float32"]
    cmd += ["--max-samples", str(MAX_SAMPLES), "--address", appliance.unix, "--json", str(out)]
    env = dict(os.environ, PYTHONHASHSEED="0")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_the_eager_reference_comes_from_a_process_without_djinn(report):
    assert report["reference"]["djinn_imported"] is False
    assert report["reference"]["hash_seed"] == "0"


def test_opinfo_ops_match_eager_and_failures_are_typed(report):
    summary = report["summary"]["float32"]
    results = report["ops"]["float32"]
    by: dict[str, list[str]] = {}
    for r in results:
        by.setdefault(r["outcome"], []).append(f"{r['op']}: {r['detail']}")
    assert summary["ops_tried"] > 650, summary  # random ops included: none drops out
    # only what eager refuses in a clean process skips: on a CPU, the CUDA-only jiterator ops
    assert all(s.startswith("jiterator_") for s in by.get("skipped", [])), by["skipped"]
    assert not by.get("wrong"), by["wrong"]  # never a silently wrong number
    assert not by.get("error"), by["error"]  # every failure is a typed DjinnError
    assert summary["pass_rate"] >= FLOOR, (summary, by.get("typed"))
    # issue 8 §2: a failure leaves the next, unrelated op alone
    leaks = [r for r in results if r.get("leaked")]
    assert not leaks, leaks


def test_sample_generation_is_deterministic():
    """The reference and the djinn run must see the same samples (Note [deterministic
    samples]): whatever runs between samples, the same seed regenerates the same ones."""
    spec = importlib.util.spec_from_file_location("ref", BENCHMARKS / "opinfo_reference.py")
    ref = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ref)
    (opinfo,) = ref.select_ops(torch.float32, "nn.functional.dropout")
    first = [ref.digest(s) for _, s in ref.iter_samples(opinfo, torch.float32)]
    again = []
    for _, sample in ref.iter_samples(opinfo, torch.float32):
        torch.randn(1000)  # draws between samples must not shift the next sample
        again.append(ref.digest(sample))
    assert first == again and len(first) > 1
