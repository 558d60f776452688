"""Replayed training steps sent behind the last one, against sent after its reply.

A replayed call (``djinn.replayable``) is sent without waiting for its reply (Note
[asynchronous replays]). Until Note [replays sent ahead] (``djinn/runtime/flights.py``)
the next call still read that reply before it sent its own graph, so the worker sat idle
from the end of one step's graph until the client had read its reply, landed it and sent
the next: a round trip and the client's own work per step. Now (the ``replay_ahead``
setting) the next replay goes while the last one runs, and the worker starts it as soon
as the last one ends.

Both ways run in one process on one private appliance, with local eager beside them in
every round: ``training_step.py``'s encoder, SGD with momentum and the default Adam
(whose steps are followed: Note [followed steps]), each compared with local eager bit for
bit, and ``Adam(capturable=True)`` (its two remote loops compared with each other bit for
bit: PyTorch has no capturable Adam on the CPU), ``--steps`` steady steps after 10 warm
calls (the recordings among them), per round, ms per step.
``--worker-threads N`` gives the CPU worker (and local eager) N intra-op threads: below
the host's cores, the client and the worker each have a core of their own (``auto``, the
default, sends ahead then, and on a GPU worker).

    python benchmarks/replay_ahead.py                     # 5 rounds of 60 steps each way
    python benchmarks/replay_ahead.py --worker-threads 1
    python benchmarks/replay_ahead.py --rounds 3 --steps 40

This machine's timings move by tens of percent from minute to minute: judge the ratios
within a round, and the medians over rounds. On the 2-core VM it was written on
(2026-11-27, medians of 5 rounds of 60 steps, ms per step, over local eager):

| worker threads | SGD ahead / after | Adam ahead / after | capturable Adam |
|---|---|---|---|
| 1 (`--worker-threads 1`) | 13.02 (1.16x) / 13.56 (1.21x) | 16.90 (1.28x) / 17.01 | 14.36 / 17.98 |
| 2, the host's cores | 19.46 (2.25x) / 18.50 (2.14x) | 23.79 (2.31x) / 26.06 | 21.56 / 23.41 |

(Adam "after" over local eager: 1.29x with one thread, 2.53x with two; capturable Adam
ahead / after, with no local eager to compare.)

With one thread ahead was faster in 4 of 5 rounds for SGD (the other equal) and in all 5
for capturable Adam; the default Adam's client, which follows its steps in Python, is
its bound either way. An earlier run, before the default Adam was sent ahead, read SGD
13.59 against 15.49 and capturable Adam 16.15 against 19.07. With two threads each way
won some rounds: the client's work for the next step takes a core from the graph that
runs. So ``auto`` sends ahead where the worker leaves the client a core (and on a GPU
worker).
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
from training_step import (
    OPTIMIZERS,
    R,
    add_worker_threads,
    batches_of,
    build,
    train_step,
    using,
    worker_threads,
)

GiB = 1 << 30
WARM = 10  # calls before the timed ones: two of them record
WAYS = ("ahead", "after")


def steady(model: torch.nn.Module, batches: list, steps: int, way: str, opt: str) -> dict:
    """ms per step of ``steps`` steps after ``WARM`` calls, and the parameters after them
    (read back, so the timing includes every step's run). ``way``: local (eager on the
    CPU), ahead or after."""
    import djinn

    device = "cpu" if way == "local" else R
    m = copy.deepcopy(model).to(device)
    optimizer = OPTIMIZERS[opt](m.parameters())
    data = [(x.to(device), y.to(device)) for x, y in batches]
    run = train_step(m, optimizer)
    if device != "cpu":
        from djinn.frontend.session import default_session

        # the replay_ahead setting, as the session's client holds it
        default_session().client.replay_ahead = "always" if way == "ahead" else "never"
        run = djinn.replayable(run)
    for i in range(WARM):
        run(*data[i % len(data)])
    if device != "cpu":
        from djinn.frontend import inflight

        inflight.land_all()
    t0 = time.perf_counter()
    for i in range(steps):
        run(*data[i % len(data)])
    params = [p.detach().cpu() for p in m.parameters()]
    ms = (time.perf_counter() - t0) / steps * 1e3
    stats = run.stats() if device != "cpu" else {}
    return {"ms": ms, "params": params, "replays": stats.get("replays")}


OPTS = ("sgd", "adam", "capturable")
LOCAL = ("sgd", "adam")  # optimizers local eager has, to compare with bit for bit
NAMES = {"sgd": "SGD", "adam": "Adam", "capturable": "capturable Adam"}
COLUMNS = {o: (["local", "ahead (/ local)", "after (/ local)"] if o in LOCAL
               else ["ahead", "after"]) for o in OPTS}  # fmt: skip


def _cells(ms: dict[str, float]) -> list[str]:
    """A row's cells: ms per step of each optimizer's ways, over local eager's."""
    cells = []
    for opt in OPTS:
        local = ms[f"{opt} local"] if opt in LOCAL else None
        if local is not None:
            cells.append(f"{local:.2f}")
        for way in WAYS:
            t = ms[f"{opt} {way}"]
            cells.append(f"{t:.2f}" + (f" ({t / local:.2f}x)" if local else ""))
    return cells


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    add_worker_threads(parser)
    parser.add_argument("--json", default="benchmarks/results/replay_ahead.json")
    args = parser.parse_args()
    extra = worker_threads(args.worker_threads)
    model = build(64, 2)
    batches = batches_of(64, 20)
    rows, runs = [], []
    with (
        tempfile.TemporaryDirectory() as tmp,
        appliance(Path(tmp), GiB, "none", **extra) as app,
        using(app.unix),
    ):
        for r in range(args.rounds):
            got: dict[str, dict] = {}
            for opt in OPTS:
                if opt in LOCAL:
                    got[f"{opt} local"] = steady(model, batches, args.steps, "local", opt)
                # alternate which way goes first, so neither always follows the other
                for way in WAYS if r % 2 == 0 else WAYS[::-1]:
                    got[f"{opt} {way}"] = steady(model, batches, args.steps, way, opt)
                # each way against local eager, bit for bit; capturable Adam (no CPU
                # eager to compare with) the two ways against each other
                ref = got[f"{opt} local" if opt in LOCAL else f"{opt} after"]["params"]
                for way in WAYS:
                    if not same(got[f"{opt} {way}"]["params"], ref):
                        print(f"round {r}: {opt} {way}: parameters differ")
                        return 1
            runs.append({k: {"ms": v["ms"], "replays": v["replays"]} for k, v in got.items()})
            rows.append([str(r), *_cells({k: v["ms"] for k, v in got.items()})])
    med = {k: statistics.median(run[k]["ms"] for run in runs) for k in runs[0]}
    rows.append(["median", *_cells(med)])
    print(md_table(["round", *(f"{NAMES[o]}: {c}" for o in OPTS for c in COLUMNS[o])], rows))
    threads = args.worker_threads or "default"
    replays = {k: v["replays"] for k, v in runs[-1].items() if v["replays"] is not None}
    print(f"\n({args.steps} steady steps a loop, worker threads: {threads}; replays in the "
          f"last round's loops: {replays}; SGD's and Adam's parameters equal local eager's "
          f"in every loop, capturable Adam's equal between the two ways; "
          f"torch {torch.__version__})")  # fmt: skip
    save_json({"rounds": runs, "medians_ms": med, "args": vars(args)}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
