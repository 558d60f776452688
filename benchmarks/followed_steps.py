"""Default-Adam training steps replayed with their steps followed, against captured.

The default ``Adam`` computes its bias corrections as Python floats from a step count it
keeps on the CPU, so a replay of a training call ending with its step cannot replay the
step with the rest. Until Note [followed steps] (``djinn/frontend/replay_follow.py``) the
replay sent the ops before the step and then captured the step, op by op, as a second
graph. Now it follows the step against the recording, in one of two ways (Note [steps
followed while the graph runs], ``replay_followed.py``; the ``follow_ahead`` setting):

- ahead (``always``): the ops before the step are sent as the call starts and run while
  the step is followed; the step then goes as a replay of its own graph;
- after (``never``): the whole call goes as one replay once the step was followed.

``djinn.replayable(fn, follow=False)`` keeps the old way (captured). All three run in
one process on one private appliance, with local eager beside them in every round:
``training_step.py``'s encoder, ``--steps`` steady steps after 10 warm calls (the
recordings among them), per round, ms per step and the client's CPU per step. Every
loop's parameters must equal local eager's bit for bit. ``--worker-threads N`` gives the
CPU worker (and local eager) N intra-op threads: below the host's cores, the client
follows on a core of its own (``auto`` then takes ahead). ``--dropout P`` trains with
dropout: its masks are drawn anew at every replay as eager draws them (Note [replayed
draws]; before that, such a call ran as it was at every call, and every row here was a
capture); each loop starts from the same seed.

    python benchmarks/followed_steps.py              # 5 rounds of 60 steps each way
    python benchmarks/followed_steps.py --rounds 3 --steps 40
    python benchmarks/followed_steps.py --worker-threads 1
    python benchmarks/followed_steps.py --dropout 0.1

This machine's timings move by tens of percent from minute to minute: judge the ratios
of the replayed rows within a round, and the medians over rounds.
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
    R,
    add_worker_threads,
    batches_of,
    build,
    train_step,
    using,
    worker_threads,
)

GiB = 1 << 30
WARM = 10  # calls before the timed ones: the first makes Adam's state, two record


def steady(model: torch.nn.Module, batches: list, steps: int, way: str) -> dict:
    """ms per step and client CPU ms per step of ``steps`` steps after ``WARM`` calls; the
    parameters after them (read back, so the timing includes every step's run). ``way``:
    local (eager on the CPU), ahead, after or captured."""
    import djinn

    device = "cpu" if way == "local" else R
    m = copy.deepcopy(model).to(device)
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    data = [(x.to(device), y.to(device)) for x, y in batches]

    step = train_step(m, opt)
    torch.manual_seed(1234)  # each way draws --dropout's masks from the same generator
    if device == "cpu":
        run = step
    else:
        from djinn.frontend.session import default_session

        # the follow_ahead setting, as the session's client holds it
        default_session().client.follow_ahead = "never" if way == "after" else "always"
        run = djinn.replayable(step, follow=way != "captured")
    for i in range(WARM):
        run(*data[i % len(data)])
    if device != "cpu":
        from djinn.frontend import inflight

        inflight.land_all()
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(steps):
        run(*data[i % len(data)])
    params = [p.detach().cpu() for p in m.parameters()]
    ms = (time.perf_counter() - t0) / steps * 1e3
    cpu = (time.process_time() - c0) / steps * 1e3
    stats = run.stats() if device != "cpu" else {}
    return {"ms": ms, "cpu_ms": cpu, "params": params, "followed": stats.get("steps_followed")}


WAYS = ("ahead", "after", "captured")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    add_worker_threads(parser)
    parser.add_argument("--dropout", type=float, default=0.0,
                        help="the encoder's dropout: its masks replay, drawn as eager "
                             "draws them (Note [replayed draws])")  # fmt: skip
    parser.add_argument("--json", default="benchmarks/results/followed_steps.json")
    args = parser.parse_args()
    extra = worker_threads(args.worker_threads)
    model = build(64, 2, args.dropout).train()
    batches = batches_of(64, 20)
    rows, runs = [], []
    with (
        tempfile.TemporaryDirectory() as tmp,
        appliance(Path(tmp), GiB, "none", **extra) as app,
        using(app.unix),
    ):
        for r in range(args.rounds):
            got = {"local": steady(model, batches, args.steps, "local")}
            for way in WAYS:
                got[way] = steady(model, batches, args.steps, way)
                pairs = zip(got[way]["params"], got["local"]["params"], strict=True)
                same = all(torch.equal(a, b) for a, b in pairs)
                if not same:
                    print(f"round {r}: {way} parameters differ from local eager's")
                    return 1
            runs.append({k: {"ms": v["ms"], "cpu_ms": v["cpu_ms"], "followed": v["followed"]}
                         for k, v in got.items()})  # fmt: skip
            local = got["local"]["ms"]
            rows.append([str(r), f"{local:.2f}",
                         *(f"{got[w]['ms']:.2f} ({got[w]['ms'] / local:.2f}x)" for w in WAYS),
                         " / ".join(f"{got[w]['cpu_ms']:.2f}" for w in WAYS),
                         " / ".join(str(got[w]["followed"]) for w in WAYS)])  # fmt: skip
    med = {k: statistics.median(run[k]["ms"] for run in runs) for k in runs[0]}
    ratios = [f"{med[w]:.2f} ({med[w] / med['local']:.2f}x)" for w in WAYS]
    rows.append(["median", f"{med['local']:.2f}", *ratios, "", ""])
    print(md_table(
        ["round", "local eager ms/step", "followed, ahead (/ local)",
         "followed, after (/ local)", "captured (/ local)",
         "client CPU ms/step, ahead / after / captured", "steps followed"],
        rows,
    ))  # fmt: skip
    threads = args.worker_threads or "default"
    print(f"\n(default Adam, dropout {args.dropout}, {args.steps} steady steps a loop, worker "
          f"threads: {threads}; every "
          f"loop's parameters equal local eager's; torch {torch.__version__})")  # fmt: skip
    save_json({"rounds": runs, "medians_ms": med, "args": vars(args)}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
