"""Batches moved in by the training loop itself against batches moved in before it.

A program that reads a data loader moves each batch to the device inside its loop
(``step(x.to(dev), y.to(dev))``). On the remote device, ``x.to(remote)`` is a put, and
until puts were sent without waiting (Note [puts sent without waiting]) it waited for the
replayed step still in flight, so the client's replay of the next step no longer
overlapped the worker's run of the last one. This times ``training_step.py``'s encoder,
replayed (``djinn.replayable``) with SGD (momentum 0.9) and the default Adam, both ways,
on one private appliance: the median seconds of ``--loops`` loops of ``--steps`` steps
each, and inside over before. Each loop's parameters are checked against local eager's.

    python benchmarks/moved_in.py
    PYTHONPATH=/path/to/an/older/checkout python benchmarks/moved_in.py   # the same, older

This machine's timings move by tens of percent from minute to minute: compare two
versions by running them in turn, several times.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from _appliance import appliance
from _common import save_json
from training_step import R, batches_of, build, loop, max_diff, using

GiB = 1 << 30


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loops", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", default="benchmarks/results/moved_in.json")
    args = parser.parse_args()
    import djinn  # noqa: F401 - the remote_accelerator device

    model = build(64, 2).train()
    batches = batches_of(64, args.steps)
    seconds: dict[str, float] = {}
    diffs: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp, appliance(Path(tmp), GiB, "none") as app:
        for optimizer in ("sgd", "adam"):
            _, want = loop(model, batches, "cpu", optimizer)
            for inside in (False, True):
                name = f"{optimizer} {'inside' if inside else 'before'}"
                with using(app.unix):
                    loop(model, batches[:4], R, optimizer, replay=True, inside=inside)  # warm
                    took = []
                    for _ in range(args.loops):
                        t, params = loop(model, batches, R, optimizer, replay=True, inside=inside)
                        took.append(t)
                        diffs[name] = max(diffs.get(name, 0.0), max_diff(params, want))
                seconds[name] = statistics.median(took)
    print(f"| replayed loop, {args.steps} steps | batches moved in before (s) | moved in by "
          "the loop (s) | by the loop / before | max |param diff| vs local eager |")  # fmt: skip
    print("|---|---|---|---|---|")
    for optimizer, label in (("sgd", "SGD (momentum 0.9)"), ("adam", "default Adam")):
        before, inside = seconds[f"{optimizer} before"], seconds[f"{optimizer} inside"]
        worst = max(diffs[f"{optimizer} before"], diffs[f"{optimizer} inside"])
        print(f"| {label} | {before:.3f} | {inside:.3f} | {inside / before:.2f}x | {worst:.1e} |")
    print(f"\n(medians of {args.loops} loops; torch {torch.__version__})")
    save_json({"seconds": seconds, "max_param_diff": diffs, "args": vars(args)}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
