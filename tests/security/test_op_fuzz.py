"""Issue 17 §2: the op-level fuzz, run for a bounded time in a child process.

The child (``tests/security/opfuzz.py``) runs hypothesis-drawn EXEC nodes over the
schemas of every allowed op through the worker's graph executor. It must finish with no
untyped error, and must not crash: a crash would kill a worker and every session on it,
so the node that killed the child is shown.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

FUZZ_SECONDS = float(os.environ.get("DJINN_OP_FUZZ_SECONDS", "20"))
ROOT = Path(__file__).resolve().parents[2]


def test_op_fuzz_finds_no_crash_and_no_untyped_error(tmp_path):
    progress = tmp_path / "progress.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.security.opfuzz", str(FUZZ_SECONDS), str(progress)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=FUZZ_SECONDS * 4 + 120,
    )
    lines = progress.read_text().splitlines() if progress.exists() else []
    last = json.loads(lines[-1]) if lines else {}
    assert proc.returncode >= 0, f"the fuzz child died of signal {-proc.returncode} on {last}"
    assert "done" in last, f"the fuzz child stopped early on {last}:\n{proc.stderr[-2000:]}"
    assert last["done"] > 100  # it did fuzz, and over many ops
    assert proc.returncode == 0, proc.stdout[-4000:]


# Nodes the longer fuzz runs found, run through the worker's graph executor in a child
# with a time limit: a node that holds the executor is as bad as one that kills it.
FOUND = [
    (  # round's meta kernel computed 10 ** decimals as a Python int: minutes per node
        {
            "op": "aten::round.decimals_out",
            "args": [{"$t": 0, "desc": {"dtype": "bool", "shape": [], "strides": []}}],
            "kwargs": {
                "decimals": 2147483647,
                "out": {"$t": 1, "desc": {"dtype": "bool", "shape": [], "strides": []}},
            },
        },
        "[torch.tensor(True), torch.tensor(False)]",
    ),
    (  # the functional _foreach_copy walked its source by its targets' length: a SIGSEGV
        {
            "op": "aten::_foreach_copy.default",
            "args": [[], [{"$t": 0, "desc": {"dtype": "float32", "shape": [1], "strides": [1]}}]],
            "kwargs": {},
        },
        "[torch.zeros(1)]",
    ),
]


def test_nodes_the_long_fuzz_found_are_refused_at_once():
    for node, inline in FOUND:
        script = (
            "import json, sys, torch\n"
            "from tests.security.opfuzz import run_one\n"
            f"print(run_one(json.loads(sys.argv[1]), {inline}))\n"
        )
        proc = subprocess.run(
            [sys.executable, "-c", script, json.dumps(node)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0 and proc.stdout.strip() == "None", proc.stderr[-500:]
