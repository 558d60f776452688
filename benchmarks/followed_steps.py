"""Default-Adam training steps replayed with their steps followed, against captured.

The default ``Adam`` computes its bias corrections as Python floats from a step count it
keeps on the CPU, so a replay of a training call ending with its step cannot replay the
step with the rest. Until Note [followed steps] (``djinn/frontend/replay_follow.py``) the
replay sent the ops before the step and then captured the step, op by op, as a second
graph; now it follows the step against the recording and sends the whole call as one
graph with this call's floats. ``djinn.replayable(fn, follow=False)`` keeps the old way,
which is what this compares against, in one process on one private appliance, with local
eager beside both in every round: ``training_step.py``'s encoder, ``--steps`` steady
steps after 10 warm calls (the recordings among them), per round, ms per step and the
client's CPU per step. Every loop's parameters must equal local eager's bit for bit.

    python benchmarks/followed_steps.py              # 5 rounds of 60 steps each way
    python benchmarks/followed_steps.py --rounds 3 --steps 40

This machine's timings move by tens of percent from minute to minute: judge the ratio of
the two replayed rows within a round, and the medians over rounds.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from _appliance import appliance
from _common import save_json
from _report import md_table
from training_step import R, build, train_step, using

GiB = 1 << 30
WARM = 10  # calls before the timed ones: the first makes Adam's state, two record


def steady(model: torch.nn.Module, batches: list, device: str, steps: int, follow: bool) -> dict:
    """ms per step and client CPU ms per step of ``steps`` steps after ``WARM`` calls; the
    parameters after them (read back, so the timing includes every step's run)."""
    import djinn

    m = copy.deepcopy(model).to(device)
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    data = [(x.to(device), y.to(device)) for x, y in batches]

    step = train_step(m, opt)
    run = step if device == "cpu" else djinn.replayable(step, follow=follow)
    for i in range(WARM):
        run(*data[i % len(data)])
    if device != "cpu":
        from djinn.frontend import trace

        trace.land_all()
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(steps):
        run(*data[i % len(data)])
    params = [p.detach().cpu() for p in m.parameters()]
    ms = (time.perf_counter() - t0) / steps * 1e3
    cpu = (time.process_time() - c0) / steps * 1e3
    stats = run.stats() if device != "cpu" else {}
    return {"ms": ms, "cpu_ms": cpu, "params": params, "followed": stats.get("steps_followed")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--json", default="benchmarks/results/followed_steps.json")
    args = parser.parse_args()
    model = build(64, 2).train()
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 32, 64, generator=gen), torch.randn(16, 32, 1, generator=gen))
               for _ in range(20)]  # fmt: skip
    rows, runs = [], []
    with (
        tempfile.TemporaryDirectory() as tmp,
        appliance(Path(tmp), GiB, "none") as app,
        using(app.unix),
    ):
        for r in range(args.rounds):
            local = steady(model, batches, "cpu", args.steps, True)
            followed = steady(model, batches, R, args.steps, True)
            captured = steady(model, batches, R, args.steps, False)
            for name, got in (("followed", followed), ("captured", captured)):
                same = all(torch.equal(a, b) for a, b in
                           zip(got["params"], local["params"], strict=True))  # fmt: skip
                if not same:
                    print(f"round {r}: {name} parameters differ from local eager's")
                    return 1
            runs.append({k: {"ms": v["ms"], "cpu_ms": v["cpu_ms"], "followed": v["followed"]}
                         for k, v in (("local", local), ("followed", followed),
                                      ("captured", captured))})  # fmt: skip
            rows.append([
                str(r), f"{local['ms']:.2f}",
                f"{followed['ms']:.2f} ({followed['ms'] / local['ms']:.2f}x)",
                f"{captured['ms']:.2f} ({captured['ms'] / local['ms']:.2f}x)",
                f"{followed['ms'] / captured['ms']:.2f}x",
                f"{followed['cpu_ms']:.2f} / {captured['cpu_ms']:.2f}",
                f"{followed['followed']} / {captured['followed']}",
            ])  # fmt: skip
    med = {k: statistics.median(run[k]["ms"] for run in runs) for k in runs[0]}
    rows.append([
        "median", f"{med['local']:.2f}",
        f"{med['followed']:.2f} ({med['followed'] / med['local']:.2f}x)",
        f"{med['captured']:.2f} ({med['captured'] / med['local']:.2f}x)",
        f"{med['followed'] / med['captured']:.2f}x", "", "",
    ])  # fmt: skip
    print(md_table(
        ["round", "local eager ms/step", "followed ms/step (/ local)",
         "captured ms/step (/ local)", "followed / captured",
         "client CPU ms/step, followed / captured", "steps followed"],
        rows,
    ))  # fmt: skip
    print(f"\n(default Adam, {args.steps} steady steps a loop; every loop's parameters equal "
          f"local eager's; torch {torch.__version__})")  # fmt: skip
    save_json({"rounds": runs, "medians_ms": med, "args": vars(args)}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
