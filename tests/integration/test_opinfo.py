"""PyTorch's OpInfo database through LazyTensor: ≥ 85 % of ops match eager, none wrong.

Runs the same code as ``benchmarks/opinfo_coverage.py`` (which prints the full report)
against the shared appliance, two samples per op to stay quick.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "opinfo_coverage.py"


@pytest.fixture(scope="module")
def coverage():
    spec = importlib.util.spec_from_file_location("opinfo_coverage", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_opinfo_ops_match_eager_and_failures_are_typed(remote, coverage):
    from torch.testing._internal.common_methods_invocations import op_db

    ops = [o for o in op_db if torch.float32 in o.supported_dtypes("cpu")]
    outcomes: dict[str, list[str]] = {}
    for opinfo in ops:
        outcome, detail, _ = coverage.run_op(opinfo, max_samples=2)
        outcomes.setdefault(outcome, []).append(f"{opinfo.full_name}: {detail}")
    tried = len(ops) - len(outcomes.get("skipped", []))
    passed = len(outcomes.get("pass", []))
    assert tried > 500
    assert not outcomes.get("wrong"), outcomes["wrong"]  # never a silently wrong number
    assert passed / tried >= 0.85, (passed, tried)
    # untyped errors are gaps to close; PyTorch's own list-index assert is the known one
    untyped = [e for e in outcomes.get("error", []) if not e.startswith("__getitem__")]
    assert not untyped, untyped
