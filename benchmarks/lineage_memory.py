"""What keeping lineage costs the client over a long training loop (Note [lineage
truncation] in djinn/runtime/lineage.py).

An Adam loop of ``--steps`` steps (default 1,000) on ``remote_accelerator`` (an MLP with
dropout, each step's batch from its own seed) runs in a child process per setting, on
one private appliance: recovery off (``recovery_retries = 0``: no journal), recovery
with the default cuts, and recovery with cuts only by bytes (``--budget``, default
8 MiB; ``recovery_checkpoint_seconds`` out of the way). Each child measures with
tracemalloc the Python memory its loop added after five warm-up steps, at the end and
at its peak, and reads the journal's own account (its bytes, peak, cuts). The figure
that matters is the difference with recovery off, and that it stops growing.

    python benchmarks/lineage_memory.py [--steps 1000] [--budget 8MiB] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _appliance import appliance, unwind_on_sigterm
from _common import MiB, note, save_json
from _report import md_table

CHILD = """
import gc, json, sys, tracemalloc
import torch
import djinn
from djinn.frontend.session import default_session

R = "remote_accelerator:0"
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(256, 10)
).to(R)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)

def step(i):
    g = torch.Generator().manual_seed(i)
    x = torch.randn(32, 64, generator=g).to(R)
    y = torch.randint(0, 10, (32,), generator=g).to(R)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss

for i in range(5):
    step(i).item()
gc.collect()
tracemalloc.start()
base = tracemalloc.get_traced_memory()[0]
samples = []
steps = int(sys.argv[1])
for i in range(steps):
    loss = step(5 + i)
    if i % 10 == 9:
        loss.item()
    if i % 100 == 99:
        gc.collect()
        samples.append(tracemalloc.get_traced_memory()[0] - base)
gc.collect()
now, peak = tracemalloc.get_traced_memory()
print(json.dumps({
    "grown": now - base, "peak": peak - base, "samples": samples,
    "journal": default_session().recovery_stats(),
}))
"""


def run(app_unix: str, steps: int, settings: dict[str, str]) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DJINN_")}
    env["DJINN_ADDRESS"] = app_unix
    env.update({f"DJINN_{k.upper()}": v for k, v in settings.items()})
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(steps)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--budget", default="8MiB", help="recovery_checkpoint_bytes")
    parser.add_argument("--json", default="benchmarks/results/lineage_memory.json")
    args = parser.parse_args()
    unwind_on_sigterm()
    cases = {
        "recovery off": {"recovery_retries": "0"},
        "recovery, default cuts": {},
        f"recovery, cuts by bytes ({args.budget})": {
            "recovery_checkpoint_bytes": args.budget,
            "recovery_checkpoint_seconds": "3600",
        },
    }
    results = {}
    with tempfile.TemporaryDirectory() as tmp, appliance(Path(tmp), 512 * MiB, "none") as app:
        for name, settings in cases.items():
            note(f"{args.steps} steps: {name}")
            results[name] = run(app.unix, args.steps, settings)
    off = results["recovery off"]["grown"]
    rows = []
    for name, r in results.items():
        j = r["journal"]
        rows.append(
            [
                name,
                f"{r['grown'] / MiB:.1f}",
                f"{r['peak'] / MiB:.1f}",
                f"{(r['grown'] - off) / MiB:+.1f}",
                " ".join(f"{s / MiB:.1f}" for s in r["samples"]),
                f"{j.get('journal_bytes', 0) / MiB:.2f}" if j else "-",
                f"{j.get('journal_peak_bytes', 0) / MiB:.2f}" if j else "-",
                str(j.get("checkpoints", "-")) if j else "-",
            ]
        )
    print(f"\n# Client memory of lineage over a {args.steps}-step Adam loop (MiB)\n")
    headers = [
        "setting",
        "grown",
        "peak",
        "vs off",
        "every 100 steps",
        "journal",
        "journal peak",
        "cuts",
    ]
    print(md_table(headers, rows))
    save_json({"steps": args.steps, "budget": args.budget, "results": results}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
