"""Sharing one worker between sessions: batching, isolation and fairness (issue 10).

Three parts, each on a fresh appliance with one CPU worker:

- **throughput**: ``--sessions`` processes decode GPT-2 (``--layers`` layers, random
  weights from a config, registered once and shared by fingerprint) at the same time,
  greedy, each from its own prompt; once with cross-session batching (``batch_max``
  = sessions) and once without (``batch_max = 1``). Reported: aggregate tokens/s, the
  p50/p99 step latency seen by the clients, the mean batch the worker ran, the share of
  the decoding time the worker spent executing (its scheduler's account), and whether
  every session's tokens were identical with and without batching.
- **isolation**: one session decodes (a step every ``--gap-ms``) beside a session that
  runs back-to-back training-step graphs of about ``--train-s`` seconds each (a chain of
  matmuls and tanh, calibrated on the worker first). Its p99 step latency beside the
  trainer over its p99 alone, under the ``semantic`` scheduler and under ``fifo``.
- **fairness**: two such trainers as two tenants (their own tokens, tenant_tokens_file)
  with weights 1:3 (scheduler_weights). Over the same window, the graphs each completed
  (their graphs are identical) and the execution seconds the worker charged each tenant
  (the stats document's ``scheduler.tenants``); both ratios are compared with 3. The
  worker's account is the measure: on a shared 2-core machine a graph runs slower while
  the other tenant's client is busy beside it, so graphs of the tenant that waits more
  often cost more seconds each and the count overstates the heavier tenant's share.

    python benchmarks/sharing.py            # about 4 minutes on 2 cores
    python benchmarks/sharing.py --quick    # a 4-layer GPT-2, fewer steps
"""

from __future__ import annotations

import argparse
import multiprocessing
import queue
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
from _workloads import chain, trainer

PROMPT = 8  # prompt tokens of each decoding session
VOCAB = 50257


def gpt2(layers: int):
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)  # every process builds the same weights: one registration
    cfg = transformers.GPT2Config(n_layer=layers)
    return transformers.GPT2LMHeadModel(cfg).eval()


def call(session: Any, fp: str, ids: torch.Tensor, past: str | None) -> tuple[torch.Tensor, str]:
    """One forward as a decode loop sends it; the logits of the last position come back."""
    from djinn.protocol.tensors import to_wire
    from djinn.runtime.remote import RemoteTensor

    desc, flat = to_wire(ids)
    kwargs: dict[str, Any] = {"use_cache": True}
    if past is not None:
        kwargs["past_key_values"] = {"$o": past}
    body = {"fingerprint": fp, "args": [{"$t": 0, "desc": desc}], "kwargs": kwargs}
    fields = session.call_model(body, [flat.numpy()])["out"]["fields"]
    logits = RemoteTensor(session, fields["logits"]["$h"], fields["logits"])
    # its handle is freed with the next request (the finalizer's piggybacked free), as a
    # real decode loop's would be: no extra round trip
    return logits.cpu()[:, -1:], fields["past_key_values"]["$o"]


def decoder(address: str, token: str, layers: int, seed: int, steps: int, gap_s: float,
            start: Any, out: Any) -> None:  # fmt: skip
    """Register the model, prefill a prompt of its own, then ``steps`` greedy decode steps
    (timed); puts (tokens, step seconds) on ``out``."""
    from djinn.frontend import remote_module
    from djinn.runtime.client import Client

    torch.set_num_threads(1)  # the client is not the subject: the cores are the worker's
    model = gpt2(layers)
    prompt = torch.randint(0, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(seed))
    with Client(address, token or None) as client, client.session() as s:
        fp = remote_module.register(model, s)["fingerprint"]
        last, cache = call(s, fp, prompt, None)
        start.wait()  # every decoder starts stepping together
        tokens, lat = [], []
        for _ in range(steps):
            nxt = last.argmax(-1)
            tokens.append(int(nxt))
            t0 = time.perf_counter()
            last, cache = call(s, fp, nxt, cache)
            lat.append(time.perf_counter() - t0)
            if gap_s:
                time.sleep(gap_s)
    out.put((seed, tokens, lat))


def fresh(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run_decoders(ctx: Any, app: Any, args: argparse.Namespace, n: int, gap_s: float = 0.0,
                 steps: int | None = None) -> dict[str, Any]:  # fmt: skip
    start, out = ctx.Barrier(n + 1), ctx.Queue()  # and this process: it reads the stats
    procs = [
        ctx.Process(
            target=decoder,
            args=(app.unix, "", args.layers, seed, steps or args.steps, gap_s, start, out),
        )
        for seed in range(n)
    ]
    for p in procs:
        p.start()
    t0 = time.perf_counter()
    with connect(app, "unix") as client:
        start.wait(args.timeout)  # every decoder has registered and prefilled
        began, exec0 = time.perf_counter(), worker_exec_s(client)
    results, deadline = [], time.monotonic() + args.timeout
    while len(results) < len(procs):
        try:
            results.append(out.get(timeout=1.0))
        except queue.Empty:
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"a decoding session failed (exit codes {failed})") from None
    decoding_s = time.perf_counter() - began
    time.sleep(0.2)  # the worker pushes its stats every 0.1 s
    with connect(app, "unix") as client:
        busy = (worker_exec_s(client) - exec0) / decoding_s
    for p in procs:
        p.join(60)
    lat = [x for _, _, ls in results for x in ls]
    wall = max(sum(ls) for _, _, ls in results)  # the slowest session's decoding time
    return {
        "tokens": {seed: toks for seed, toks, _ in results},
        "tokens_per_s": len(lat) / wall,
        "p50_ms": 1e3 * statistics.median(lat),
        "p99_ms": 1e3 * pct(lat, 0.99),
        "wall_s": time.perf_counter() - t0,
        "worker_busy": busy,  # of the decoding time, the share the worker was executing
    }


def worker_exec_s(client: Any) -> float:
    """The worker's execution seconds so far, every tenant's (its scheduler's account)."""
    tenants = client.stats()["scheduler"][0]["tenants"]
    return sum(t["exec_s"] for t in tenants.values())


def ceiling(layers: int, rows: int, threads: int, reps: int = 5) -> dict[str, float]:
    """The most batching can give here: one decode step of ``rows`` rows against one of a
    single row, in this process with no appliance, on the worker's torch threads (a CPU
    decode step is not bound by reading the weights alone: its compute grows with the
    rows too)."""
    default = torch.get_num_threads()
    if threads > 0:
        torch.set_num_threads(threads)
    try:
        return _ceiling(layers, rows, reps)
    finally:
        torch.set_num_threads(default)


def _ceiling(layers: int, rows: int, reps: int) -> dict[str, float]:
    model = gpt2(layers)
    per_row = {}
    with torch.no_grad():
        for n in (1, rows):
            out = model(torch.randint(0, VOCAB, (n, PROMPT)), use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
            times = []
            for _ in range(reps + 1):
                t0 = time.perf_counter()
                model(nxt, past_key_values=out.past_key_values, use_cache=True)
                times.append(time.perf_counter() - t0)
                out.past_key_values.crop(-1)
            per_row[n] = statistics.median(times[1:])
    return {"step1_ms": 1e3 * per_row[1], "step_batch_ms": 1e3 * per_row[rows],
            "speedup": rows * per_row[1] / per_row[rows]}  # fmt: skip


def throughput(ctx: Any, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    runs: dict[str, Any] = {"ceiling": ceiling(args.layers, args.sessions, args.cpu_threads)}
    for label, batch_max in (("unbatched", 1), ("batched", args.sessions)):
        note(f"throughput: {args.sessions} sessions decoding, {label}")
        settings = {
            "batch_max": batch_max,
            "batch_wait_us": args.batch_wait_us,
            "cpu_threads": args.cpu_threads,
        }
        with appliance(fresh(tmp / label), 2048 * MiB, "none", cpu_worker_memory="4GiB",
                       **settings) as app:  # fmt: skip
            runs[label] = run_decoders(ctx, app, args, args.sessions)
            with connect(app, "unix") as client:
                runs[label]["batching"] = client.stats()["scheduler"][0]["batching"]
    runs["identical"] = runs["batched"]["tokens"] == runs["unbatched"]["tokens"]
    return runs


def calibrate(app: Any, size: int, train_s: float) -> int:
    """mm+tanh pairs for one training-step graph of about ``train_s`` seconds."""
    with connect(app, "unix") as client, client.session() as s:
        h = s.put(torch.randn(size, size) / size**0.5)
        pairs = 20
        for _ in range(2):  # the second time on a warm worker
            t0 = time.perf_counter()
            s.execute(chain(h.handle, pairs), fetch=[{"$v": 2 * pairs - 1}])
            took = time.perf_counter() - t0
        return max(1, int(pairs * train_s / took))


def isolation(ctx: Any, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for policy in ("fifo", "semantic"):
        note(f"isolation: a decoder beside {args.train_s:.1f} s training steps, {policy}")
        with appliance(fresh(tmp / f"iso-{policy}"), 2048 * MiB, "none", scheduler=policy,
                       cpu_worker_memory="4GiB", cpu_threads=args.cpu_threads) as app:  # fmt: skip
            pairs = calibrate(app, args.size, args.train_s)
            steps = args.iso_steps
            alone = run_decoders(ctx, app, args, 1, args.gap_ms / 1e3, steps)
            stop, done = ctx.Event(), ctx.Value("i", 0)
            proc = ctx.Process(target=trainer, args=(app.unix, "", args.size, pairs, stop, done))
            proc.start()
            while done.value == 0:  # the trainer has run a graph
                time.sleep(0.05)
            beside = run_decoders(ctx, app, args, 1, args.gap_ms / 1e3, steps)
            stop.set()
            proc.join(120)
        out[policy] = {"pairs": pairs, "alone": alone, "beside": beside}
    return out


def fairness(ctx: Any, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    note("fairness: two trainers, tenants weighted 1:3")
    fresh(tmp / "fair")
    tokens = {"light": "light-" + "x" * 20, "heavy": "heavy-" + "y" * 20}
    tenants = tmp / "fair" / "tenants"
    tenants.write_text("".join(f"{name} {tok}\n" for name, tok in tokens.items()))
    with appliance(tmp / "fair", 256 * MiB, "none", tenant_tokens_file=str(tenants),
                   scheduler_weights="token:light=1, token:heavy=3",
                   cpu_threads=args.cpu_threads) as app:  # fmt: skip
        pairs = calibrate(app, args.size, args.fair_graph_s)
        stop = ctx.Event()
        done = {name: ctx.Value("i", 0) for name in tokens}
        procs = [
            ctx.Process(target=trainer, args=(app.tcp, tokens[n], args.size, pairs, stop, done[n]))
            for n in tokens
        ]
        for p in procs:
            p.start()
        while not all(d.value for d in done.values()):
            time.sleep(0.05)
        time.sleep(2.0)  # past the first seconds, when usage is still building up
        with connect(app, "unix") as client:
            first = {n: d.value for n, d in done.items()}
            first_s = tenant_exec_s(client)
            time.sleep(args.fair_s)
            counts = {n: d.value - first[n] for n, d in done.items()}
            exec_s = {n: tenant_exec_s(client)[n] - first_s[n] for n in tokens}
        stop.set()
        for p in procs:
            p.join(120)
    return {
        "graphs": counts,
        "ratio": counts["heavy"] / max(1, counts["light"]),
        "exec_s": exec_s,
        "exec_ratio": exec_s["heavy"] / max(1e-9, exec_s["light"]),
        "pairs": pairs,
    }


def tenant_exec_s(client: Any) -> dict[str, float]:
    """The worker's own account: execution seconds of tenants ``token:light`` and
    ``token:heavy`` so far (the stats document's scheduler row; pushed every 0.1 s)."""
    tenants = client.stats()["scheduler"][0]["tenants"]
    return {n: tenants.get(f"token:{n}", {}).get("exec_s", 0.0) for n in ("light", "heavy")}


def report(doc: dict[str, Any], args: argparse.Namespace) -> None:
    if "throughput" in doc:
        t = doc["throughput"]
        print(f"\nThroughput: {args.sessions} sessions decoding GPT-2 ({args.layers} layers)")
        print(md_table(
            ["", "tokens/s", "step p50 ms", "step p99 ms", "mean batch", "worker busy"],
            [[label, f"{t[label]['tokens_per_s']:.1f}", f"{t[label]['p50_ms']:.1f}",
              f"{t[label]['p99_ms']:.1f}", str(t[label]["batching"]["mean"] or "-"),
              f"{t[label]['worker_busy']:.0%}"]
             for label in ("unbatched", "batched")],
        ))  # fmt: skip
        speedup = t["batched"]["tokens_per_s"] / t["unbatched"]["tokens_per_s"]
        print(f"batched / unbatched: {speedup:.2f}x; tokens identical: {t['identical']} "
              f"(batch_max {args.sessions}, batch_wait_us {args.batch_wait_us}, "
              f"cpu_threads {args.cpu_threads})")  # fmt: skip
        c = t["ceiling"]
        print(f"ceiling in this process, same run: a step of {args.sessions} rows "
              f"{c['step_batch_ms']:.1f} ms, of 1 row {c['step1_ms']:.1f} ms: at most "
              f"{c['speedup']:.2f}x from batching on this machine")  # fmt: skip
    if "isolation" in doc:
        iso = doc["isolation"]
        print(f"\nIsolation: decode step every {args.gap_ms:g} ms beside ~{args.train_s:g} s "
              "training steps")  # fmt: skip
        print(md_table(
            ["policy", "alone p99 ms", "beside p50 ms", "beside p99 ms", "p99 / alone"],
            [[p, f"{iso[p]['alone']['p99_ms']:.1f}", f"{iso[p]['beside']['p50_ms']:.1f}",
              f"{iso[p]['beside']['p99_ms']:.1f}",
              f"{iso[p]['beside']['p99_ms'] / iso[p]['alone']['p99_ms']:.2f}x"]
             for p in ("fifo", "semantic")],
        ))  # fmt: skip
    if "fairness" in doc:
        f = doc["fairness"]
        light, heavy = f["graphs"]["light"], f["graphs"]["heavy"]
        busy = (f["exec_s"]["light"] + f["exec_s"]["heavy"]) / args.fair_s
        print(
            f"\nFairness: weights 1:3 over {args.fair_s:g} s, steps of ~{args.fair_graph_s:g} s "
            f"(goal 3, within 10%); the worker ran their graphs {busy:.0%} of the window"
        )
        print(md_table(
            ["tenant", "weight", "graphs completed", "execution s (worker's account)"],
            [["light", "1", str(light), f"{f['exec_s']['light']:.2f}"],
             ["heavy", "3", str(heavy), f"{f['exec_s']['heavy']:.2f}"],
             ["heavy / light", "3", f"{f['ratio']:.2f}", f"{f['exec_ratio']:.2f}"]],
        ))  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--steps", type=int, default=24, help="decode steps per session")
    parser.add_argument("--iso-steps", type=int, default=60)
    parser.add_argument("--gap-ms", type=float, default=20.0, help="isolation: think time")
    parser.add_argument("--train-s", type=float, default=1.0, help="isolation: one step")
    parser.add_argument("--size", type=int, default=384, help="trainer matrices")
    parser.add_argument(
        "--fair-graph-s",
        type=float,
        default=0.2,
        help="fairness: one training step; much shorter steps leave the heavier tenant's "
        "client too little time between them to keep its share queued",
    )
    parser.add_argument("--fair-s", type=float, default=20.0)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument(
        "--batch-wait-us",
        type=int,
        default=50_000,
        help="batch_wait_us of the batched run: on a CPU worker with 8 client processes on "
        "2 cores, the clients take tens of ms to send their next steps",
    )
    parser.add_argument(
        "--cpu-threads",
        type=int,
        default=1,
        help="every part: the worker's cpu_threads, and the ceiling's (0: torch's default). "
        "The 8 clients run on the worker's 2 cores here: with 2 threads the worker's "
        "OpenMP threads wait for a sibling a client has descheduled at every op",
    )
    parser.add_argument(
        "--parts", default="throughput,isolation,fairness", help="which parts to run"
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default="benchmarks/results/sharing.json")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.steps, args.iso_steps, args.fair_s = 4, 12, 30, 6.0
    unwind_on_sigterm()
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        doc: dict[str, Any] = {"torch": torch.__version__, "args": vars(args)}
        for part, run in (("throughput", throughput), ("isolation", isolation),
                          ("fairness", fairness)):  # fmt: skip
            if part in args.parts:
                doc[part] = run(ctx, args, Path(tmp))
    report(doc, args)
    if "throughput" in doc:
        for label in ("batched", "unbatched"):
            doc["throughput"][label]["tokens"] = None
    save_json(doc, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
