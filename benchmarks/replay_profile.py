#!/usr/bin/env python
"""Where a replayed training step's time goes: the client's Python, the worker's, or the wait.

A GPU run of ``benchmarks/gpu.py`` (stop 36) put a replayed SGD step of
``training_step.py``'s encoder at 1.5-2.0x local eager, with or without CUDA graphs, so the
worker's kernel launches were not what it spent. This script answers what is: it replays
that step (``djinn.replayable``, SGD with momentum) for ``--seconds`` on a private
appliance, and reports, side by side for the same steps:

- the step's wall time (between two calls' returns, past the recordings);
- the client's CPU time per step (``time.process_time`` of this process, all threads);
- the worker's CPU time per step (``psutil`` on the worker process);
- with ``--py-spy PATH`` (a py-spy binary; install it with ``pip install py-spy``): the
  worker's most sampled lines, and the client's, from a py-spy record of each at
  ``--rate`` Hz. Sampling slows both, so its per-step times are not the ones above: the
  profile runs after them, on more steps.

    python benchmarks/replay_profile.py                       # GPU workers if there are GPUs
    python benchmarks/replay_profile.py --gpus none --seconds 5
    python benchmarks/replay_profile.py --py-spy /tmp/pyspy/bin/py-spy
    python benchmarks/replay_profile.py --workload adam            # the default Adam
    python benchmarks/replay_profile.py --workload adam --dropout 0.1   # its draws replayed
    python benchmarks/replay_profile.py --workload put_get --nbytes 1048576

``--workload`` picks the step: the replayed step with one of training_step.py's
optimizers, or ``put_get``, a put and a get of ``--nbytes`` through one client session.
``--raw DIR`` keeps py-spy's raw records; ``--native`` samples C/C++ frames too.

Prints markdown tables; ``--json`` writes them.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
from _appliance import appliance, device_of, unwind_on_sigterm
from _common import GiB, note, save_json
from training_step import OPTIMIZERS, batches_of, build, scheduler_stats, train_step, using

R = "remote_accelerator:0"
WORKLOADS = (*OPTIMIZERS, "put_get")


def replayed_step(optimizer: str, width: int, layers: int, dropout: float) -> tuple[Any, list]:
    """The replayed step of training_step.py's encoder, and its batches on the device."""
    import djinn

    model = build(width, layers, dropout).train().to(R)
    data = [(x.to(R), y.to(R)) for x, y in batches_of(width, 8)]
    return djinn.replayable(train_step(model, OPTIMIZERS[optimizer](model.parameters()))), data


class PutGet:
    """A put and a get of one float32 tensor of ``nbytes`` through a client session, as
    ``transport.py`` times them: what a step is for the ``put_get`` workload."""

    def __init__(self, session: Any) -> None:
        self.session, self.steps = session, 0

    def __call__(self, t: Any) -> None:
        self.session.put(t).cpu()
        self.steps += 1

    def stats(self) -> dict[str, int]:
        return {"put_gets": self.steps}


def run_for(run: Any, data: list, seconds: float) -> int:
    """Replayed steps for ``seconds``, every one landed at the end; how many."""
    from djinn.frontend import inflight

    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        run(*data[n % len(data)])
        n += 1
    inflight.land_all()
    return n


def top_lines(raw: Path, count: int) -> list[tuple[str, float]]:
    """The most sampled innermost frames of a py-spy ``--format raw`` record, as shares."""
    leaves: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        leaves[stack.split(";")[-1]] += int(n)
        total += int(n)
    return [(frame, round(n / total, 3)) for frame, n in leaves.most_common(count)] if total else []


def profile(spy: str, pids: dict[str, int], run: Any, data: list, seconds: float,
            rate: int, tmp: Path, native: bool) -> dict[str, Any]:  # fmt: skip
    """py-spy records of each of ``pids`` while the step replays for ``seconds``."""
    procs = {}
    for name, pid in pids.items():
        out = tmp / f"{name}.txt"
        cmd = [spy, "record", "-p", str(pid), "-r", str(rate), "-d", str(int(seconds) + 1),
               "-f", "raw", "-o", str(out)]  # fmt: skip
        # py-spy reads native stacks only from a paused process: sampling then slows it more
        cmd += ["--native"] if native else ["--nonblocking"]
        procs[name] = (subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, text=True), out)  # fmt: skip
    time.sleep(0.5)  # py-spy attaches
    steps = run_for(run, data, seconds)
    found: dict[str, Any] = {"steps": steps}
    for name, (proc, out) in procs.items():
        _, err = proc.communicate(timeout=60)
        found[name] = top_lines(out, 15) if out.exists() else {"error": err.strip()[-500:]}
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", default="auto", help="the appliance's gpus setting")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dropout", type=float, default=0.0,
                        help="the encoder's dropout (Note [replayed draws])")  # fmt: skip
    parser.add_argument("--py-spy", default=None, help="a py-spy binary: profile both sides")
    parser.add_argument("--rate", type=int, default=500, help="py-spy samples per second")
    parser.add_argument("--native", action="store_true", help="py-spy's C/C++ frames too")
    parser.add_argument("--workload", default="sgd", choices=WORKLOADS,
                        help="what a step is: a replayed training step with this optimizer, "
                             "or a put and a get of --nbytes")  # fmt: skip
    parser.add_argument("--nbytes", type=int, default=16,
                        help="the put_get workload's size (float32s: a multiple of 4)")  # fmt: skip
    parser.add_argument("--raw", default=None, help="a folder for py-spy's raw records")
    parser.add_argument("--json", default=None,
                        help="default: benchmarks/results/replay_profile[_W].json")  # fmt: skip
    args = parser.parse_args()
    if args.nbytes < 4 or args.nbytes % 4:
        parser.error("--nbytes must be a positive multiple of 4 (float32s)")
    if (args.raw or args.native) and not args.py_spy:
        parser.error("--raw and --native need --py-spy")
    if args.json is None:
        tail = "" if args.workload == "sgd" else f"_{args.workload}"
        tail += f"_dropout{args.dropout}" if args.dropout else ""
        args.json = f"benchmarks/results/replay_profile{tail}.json"
    unwind_on_sigterm()
    doc: dict[str, Any] = {"benchmark": "replay_profile", "seconds": args.seconds,
                           "workload": args.workload, "nbytes": args.nbytes,
                           "dropout": args.dropout}  # fmt: skip
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory())
        app = stack.enter_context(appliance(Path(tmp), GiB, args.gpus))
        stack.enter_context(using(app.unix))
        doc["device"] = device_of(app.readiness)
        worker = next(
            p for p in psutil.Process(app.proc.pid).children(recursive=True)
            if "djinn.appliance.worker" in " ".join(p.cmdline())
        )  # fmt: skip
        if args.workload == "put_get":
            import torch

            from djinn.runtime.client import Client

            session = stack.enter_context(Client(app.unix).session())
            run: Any = PutGet(session)
            data = [(torch.arange(args.nbytes // 4, dtype=torch.float32),)]
        else:
            run, data = replayed_step(args.workload, args.width, args.layers, args.dropout)
        run_for(run, data, 1.0)  # recordings, plans compiled, graphs captured
        note(f"running {args.workload} for {args.seconds} s on {doc['device']}")
        wall0, cpu0, w0 = time.perf_counter(), time.process_time(), worker.cpu_times()
        steps = run_for(run, data, args.seconds)
        wall, cpu, w1 = time.perf_counter() - wall0, time.process_time() - cpu0, worker.cpu_times()
        worker_cpu = (w1.user + w1.system) - (w0.user + w0.system)
        doc["steps"] = steps
        doc["ms_per_step"] = {
            "wall": round(wall / steps * 1e3, 3),
            "client_cpu": round(cpu / steps * 1e3, 3),
            "worker_cpu": round(worker_cpu / steps * 1e3, 3),
        }
        doc["replay"] = run.stats()
        time.sleep(0.5)  # the worker's stats reach the supervisor every STATS_PUSH_S
        doc["cuda_graphs"] = scheduler_stats(app.unix, "cuda_graphs")
        doc["graph_plans"] = scheduler_stats(app.unix, "graph_plans")
        if args.py_spy:
            note(f"py-spy on the worker and this process, {args.rate} Hz")
            pids = {"worker": worker.pid, "client": os.getpid()}
            raw = Path(args.raw or tmp)
            raw.mkdir(parents=True, exist_ok=True)
            doc["profile"] = profile(args.py_spy, pids, run, data, args.seconds, args.rate,
                                     raw, args.native)  # fmt: skip
    report(doc)
    save_json(doc, args.json)
    return 0


def report(doc: dict[str, Any]) -> None:
    ms = doc["ms_per_step"]
    what = {"put_get": f"A put and a get of {doc['nbytes']} bytes"}.get(
        doc["workload"], f"Replayed {doc['workload']} step of training_step.py's encoder"
    )
    what += f" with dropout {doc['dropout']}" if doc.get("dropout") else ""
    print(f"\n{what} on {doc['device']}, {doc['steps']} steps in {doc['seconds']} s\n")
    print("| per step | ms |\n|---|---|")
    print(f"| wall (between two calls' returns) | {ms['wall']} |")
    print(f"| client CPU (this process, all threads) | {ms['client_cpu']} |")
    print(f"| worker CPU | {ms['worker_cpu']} |")
    print(f"\nreplays: {doc['replay']}\nCUDA graphs: {doc['cuda_graphs']}")
    prof = doc.get("profile")
    if prof:
        print(f"\npy-spy, {prof['steps']} steps while sampled:")
        for side in ("worker", "client"):
            lines = prof.get(side)
            print(f"\n| {side}: innermost frame | share of samples |\n|---|---|")
            if isinstance(lines, dict):
                print(f"| (failed: {lines['error']}) | |")
                continue
            for frame, share in lines:
                print(f"| {frame[:110]} | {share:.1%} |")


if __name__ == "__main__":
    sys.exit(main())
