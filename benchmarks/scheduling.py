"""Interactive latency beside throughput work on one worker: semantic scheduler vs fifo.

One session (in its own process) runs long op graphs back to back, as a training loop
does: a chain of matmuls and tanh, ``--chain`` pairs per request. Another session sends a
small graph (one add, result fetched) every ``--gap-ms`` and times each round trip. The
interactive session is measured alone first (the floor), then beside the trainer, once
per scheduling policy, each on a fresh appliance; ``--rounds`` alternates the policies
so that both see the same machine. Reported: interactive p50 / p99 and p99 over the floor,
and the trainer's graphs per second (what preempting it costs).

    python benchmarks/scheduling.py                 # 2 rounds, about 2 minutes
    python benchmarks/scheduling.py --rounds 1 --iters 100
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _appliance import appliance, connect, unwind_on_sigterm
from _common import MiB, note, save_json
from _report import md_table
from _workloads import trainer

POLICIES = ("fifo", "semantic")
N = 256


def interactive(app: Any, iters: int, gap_s: float) -> list[float]:
    """Round-trip seconds of a one-op graph with its result fetched."""
    lat = []
    with connect(app, "unix") as client, client.session() as s:
        x = s.put(torch.ones(16))
        node = {"op": "aten::add.Tensor", "args": [{"$h": x.handle}, 1.0]}
        for _ in range(iters):
            t0 = time.perf_counter()
            s.execute([node], fetch=[{"$v": 0}])
            lat.append(time.perf_counter() - t0)
            time.sleep(gap_s)
    return lat


def summary(lat: list[float]) -> dict[str, float]:
    lat = sorted(lat)
    return {
        "p50_ms": 1e3 * statistics.median(lat),
        "p99_ms": 1e3 * lat[min(len(lat) - 1, int(0.99 * len(lat)))],
    }


def one_run(policy: str, args: argparse.Namespace, ctx: Any) -> dict[str, Any]:
    with (
        tempfile.TemporaryDirectory() as tmp,
        appliance(Path(tmp), 256 * MiB, "none", scheduler=policy) as app,
    ):
        interactive(app, 20, 0.0)  # warm the worker's kernels and caches
        alone = summary(interactive(app, args.iters, args.gap_ms / 1e3))
        stop, done = ctx.Event(), ctx.Value("i", 0)
        proc = ctx.Process(target=trainer, args=(app.unix, "", N, args.chain, stop, done))
        proc.start()
        while done.value == 0:  # the trainer is up and has run a graph
            time.sleep(0.05)
        start, first = time.perf_counter(), done.value
        beside = summary(interactive(app, args.iters, args.gap_ms / 1e3))
        graphs_per_s = (done.value - first) / (time.perf_counter() - start)
        stop.set()
        proc.join(60)
        with connect(app, "unix") as client:
            sched = client.stats()["scheduler"][0]
    return {"policy": policy, "alone": alone, "beside": beside,
            "trainer_graphs_per_s": graphs_per_s, "scheduler": sched}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--gap-ms", type=float, default=10.0)
    parser.add_argument("--chain", type=int, default=50, help="mm+tanh pairs per graph")
    parser.add_argument("--json", default="benchmarks/results/scheduling.json")
    args = parser.parse_args()
    unwind_on_sigterm()
    ctx = multiprocessing.get_context("spawn")
    runs = []
    for r in range(args.rounds):
        for policy in POLICIES if r % 2 == 0 else POLICIES[::-1]:
            note(f"round {r + 1}/{args.rounds}: {policy}")
            runs.append(one_run(policy, args, ctx))
    rows, doc = [], {"runs": runs, "torch": torch.__version__}
    for policy in POLICIES:
        mine = [x for x in runs if x["policy"] == policy]
        alone_p99 = statistics.median(x["alone"]["p99_ms"] for x in mine)
        beside_p50 = statistics.median(x["beside"]["p50_ms"] for x in mine)
        beside_p99 = statistics.median(x["beside"]["p99_ms"] for x in mine)
        rate = statistics.median(x["trainer_graphs_per_s"] for x in mine)
        doc[policy] = {"alone_p99_ms": alone_p99, "beside_p50_ms": beside_p50,
                       "beside_p99_ms": beside_p99, "trainer_graphs_per_s": rate}  # fmt: skip
        rows.append([policy, f"{alone_p99:.2f}", f"{beside_p50:.2f}", f"{beside_p99:.2f}",
                     f"{beside_p99 / alone_p99:.1f}x", f"{rate:.2f}"])  # fmt: skip
    print(md_table(["policy", "alone p99 ms", "beside trainer p50 ms", "beside p99 ms",
                    "p99 / alone", "trainer graphs/s"], rows))  # fmt: skip
    print(
        f"\n(each graph of the trainer: {2 * args.chain} ops on {N}x{N}; medians of "
        f"{args.rounds} round(s); interactive: one add + fetch every {args.gap_ms} ms)"
    )
    save_json(doc, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
