"""Memory pressure (issue 9): more work than device memory, under each memory policy.

Two scenarios, each on its own appliance per policy, all in the same run:

- **agents**: N sessions share one registered GPT-2-shaped model. Each prefills a
  context, then alternates bursts of decode steps with a think time. The worker's
  memory holds the weights plus the KV caches of about 3 sessions. Policies compared:
  ``semantic``, ``lru`` and ``off`` (today's behaviour: nothing moves, a call that
  does not fit is refused). Reports sessions completed, errors, decode-step latency
  (p50/p99, client-measured, swap-ins included), bytes moved, and swap-in throughput
  against memcpy measured in the same run (on a CPU worker the host<->device copy *is*
  a memcpy).
- **many models**: 4 different models whose weights add up to 2x device memory, called
  round-robin. Reports the time to switch a model in (the appliance's swap-in time per
  model) against loading the same weights from safetensors files, and the host tier's
  peak against one host copy per model.

Sizes are scaled so that a 2-core CPU machine runs everything in a few minutes (the
issue's figures are for a GPU: GPT-2 small, 512-token contexts, 12 agents); ``--full``
uses GPT-2 small's width and 12 layers. Timings mean little on a shared machine; the
ratios (policy against policy, swap-in against memcpy, switch against load) are taken in
the same run.

    python benchmarks/pressure.py            # 5-8 minutes on 2 shared cores
    python benchmarks/pressure.py --quick    # smoke run, ~2 minutes
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from _appliance import appliance, connect, unwind_on_sigterm
from _common import MiB, save_json
from _report import md_table

POLICIES = ("semantic", "lru", "off")


def note(msg: str) -> None:
    print(f"[pressure] {msg}", file=sys.stderr, flush=True)


# -- helpers ---------------------------------------------------------------------------
def gpt2(n_layer: int, n_embd: int, seed: int, n_positions: int = 1024):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=max(1, n_embd // 64),
        vocab_size=1000,
        n_positions=n_positions,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(cfg).eval()


def load_and_build(path: Path, config: Any) -> torch.nn.Module:
    """A model from its safetensors file: built on meta, given the file's tensors."""
    from safetensors.torch import load_file
    from transformers import GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(config)
    state = {k: v.clone() for k, v in load_file(str(path)).items()}
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    return model.eval()


def weight_bytes(model: torch.nn.Module) -> int:
    seen = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    return sum(seen.values()) + sum(b.numel() * b.element_size() for b in model.buffers())


def call(session: Any, fp: str, ids: torch.Tensor, past: str | None) -> tuple[int, str]:
    """One forward; returns (greedy next token, the KV cache's remote id)."""
    from djinn.protocol.tensors import to_wire
    from djinn.runtime.remote import RemoteTensor

    desc, flat = to_wire(ids)
    kwargs: dict[str, Any] = {"use_cache": True}
    if past is not None:
        kwargs["past_key_values"] = {"$o": past}
    body = {"fingerprint": fp, "args": [{"$t": 0, "desc": desc}], "kwargs": kwargs}
    fields = session.call_model(body, [flat.numpy()])["out"]["fields"]
    logits = RemoteTensor(session, fields["logits"]["$h"], fields["logits"])
    return int(logits.cpu()[0, -1].argmax()), fields["past_key_values"]["$o"]


def memcpy_gbps(nbytes: int = 64 * MiB, rounds: int = 5) -> float:
    """The best of torch's copy_ and a plain memcpy (numpy) into a warm buffer."""
    import numpy as np

    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(rounds))
    best = min(best, *(_timed(lambda: np.copyto(dst.numpy(), src.numpy())) for _ in range(rounds)))
    return nbytes / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def workdir_for(root: Path, name: str) -> Path:
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def stats_of(app) -> dict[str, Any]:
    with connect(app, "unix") as client:
        return client.stats()


# -- agents ----------------------------------------------------------------------------
def agents(policy: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from djinn.frontend import remote_module

    model = gpt2(args.layers, args.width, seed=0)
    wbytes = weight_bytes(model)
    tokens = args.context + args.rounds * args.burst
    kv = 2 * args.layers * args.width * 4 * tokens
    memory = wbytes + int(3.3 * kv) + 4 * MiB  # weights + ~3 sessions' caches + logits
    settings = {"cpu_worker_memory": memory, "memory_policy": policy, "cpu_workers": 1}
    if policy == "off":  # today's behaviour: no eviction and no waiting, refused at once
        settings["admission_timeout"] = 0.0
    latencies: list[float] = []
    errors: list[str] = []
    completed = 0
    lock = threading.Lock()

    def agent(i: int) -> None:
        nonlocal completed
        rng = random.Random(i)
        with connect(app, "unix") as client, client.session() as s:
            try:
                fp = remote_module.register(model, s)["fingerprint"]
                time.sleep(rng.uniform(0, args.think))  # agents do not start in lockstep
                gen = torch.Generator().manual_seed(i)
                ids = torch.randint(0, 1000, (1, args.context), generator=gen)
                nxt, cache = call(s, fp, ids, None)
                for _round in range(args.rounds):
                    for _ in range(args.burst):
                        t0 = time.perf_counter()
                        nxt, cache = call(s, fp, torch.tensor([[nxt]]), cache)
                        with lock:
                            latencies.append(time.perf_counter() - t0)
                    time.sleep(args.think * rng.uniform(0.5, 1.5))  # a tool call, a reader
                with lock:
                    completed += 1
            except Exception as exc:  # a refused call ends that agent: counted, not fatal
                with lock:
                    errors.append(f"{type(exc).__name__}: {str(exc)[:120]}")

    # the host tier holds the weights' copy and every cache swapped out (issue 9 §1):
    # the arena is sized for all of them, at the full scale too
    arena = max(512 * MiB, wbytes + args.sessions * kv * 3 // 2 + 256 * MiB)
    with appliance(workdir_for(workdir, f"agents-{policy}"), arena, "none", **settings) as app:
        t0 = time.perf_counter()
        threads = [threading.Thread(target=agent, args=(i,)) for i in range(args.sessions)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - t0
        st = stats_of(app)
    mem = st["memory"][0]
    return {
        "policy": policy,
        "device_bytes": memory,
        "weights_bytes": wbytes,
        "kv_bytes_per_session": kv,
        "completed": completed,
        "errors": len(errors),
        "first_errors": errors[:3],
        "steps": len(latencies),
        "p50_ms": pct(latencies, 0.5) * 1e3,
        "p99_ms": pct(latencies, 0.99) * 1e3,
        "elapsed_s": round(elapsed, 2),
        "memory": mem,
    }


# -- many models -----------------------------------------------------------------------
def many_models(policy: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from safetensors.torch import load_file, save_file

    from djinn.frontend import remote_module

    models = [gpt2(args.mm_layers, args.width, seed=10 + i) for i in range(4)]
    wbytes = [weight_bytes(m) for m in models]
    memory = sum(wbytes) // 2  # the four models' weights are 2x device memory
    # What a switch competes with: loading the same model from its safetensors files.
    # load_file alone only maps the file (safetensors is lazy); a usable model also needs
    # building and its bytes materialised, as the appliance's own load path does.
    load_s, build_s = [], []
    for i, m in enumerate(models):
        path = workdir / f"model{i}.safetensors"
        state = {k: v.contiguous() for k, v in m.state_dict().items() if k != "lm_head.weight"}
        save_file(state, str(path))
        load_file(str(path))  # warm the page cache: the loader's best case
        load_s.append(min(_timed(lambda p=path: load_file(str(p))) for _ in range(3)))
        build = lambda p=path, c=m.config: load_and_build(p, c)  # noqa: E731
        build_s.append(min(_timed(build) for _ in range(3)))
    settings = {"cpu_worker_memory": memory, "memory_policy": policy, "cpu_workers": 1}
    latencies: list[float] = []
    errors = 0
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    with appliance(workdir_for(workdir, f"models-{policy}"), 1024 * MiB, "none", **settings) as app:
        clients = [connect(app, "unix") for _ in models]
        sessions = [c.session() for c in clients]
        fps = []
        try:
            for s, m in zip(sessions, models, strict=True):
                fps.append(remote_module.register(m, s)["fingerprint"])
            for _round in range(args.mm_rounds):
                for s, fp in zip(sessions, fps, strict=True):
                    t0 = time.perf_counter()
                    try:
                        call(s, fp, ids, None)
                    except Exception:
                        errors += 1
                        continue
                    latencies.append(time.perf_counter() - t0)
            st = stats_of(app)
        finally:
            for s in sessions:
                s.close()
            for c in clients:
                c.close()
    mem = st["memory"][0]
    swap_in = mem["swap_in_s"] / mem["swaps_in"] if mem["swaps_in"] else float("nan")
    return {
        "policy": policy,
        "device_bytes": memory,
        "weights_bytes": wbytes,
        "calls": len(latencies),
        "errors": errors,
        "call_p50_ms": pct(latencies, 0.5) * 1e3,
        "swap_in_ms": swap_in * 1e3,
        "load_ms": statistics.mean(load_s) * 1e3,
        "load_build_ms": statistics.mean(build_s) * 1e3,
        "host_peak": mem["host_peak"],
        "memory": mem,
    }


def summarise(policy: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row per policy: the median run's figures, the worst run's completions."""
    med = lambda key: statistics.median(r[key] for r in runs)  # noqa: E731
    mem = lambda key: statistics.median(r["memory"].get(key, 0) for r in runs)  # noqa: E731
    first = runs[0]
    return {
        **{k: first[k] for k in ("device_bytes", "weights_bytes", "kv_bytes_per_session")},
        "policy": policy,
        "runs": len(runs),
        "completed": min(r["completed"] for r in runs),
        "errors": max(r["errors"] for r in runs),
        "first_errors": sorted({e for r in runs for e in r["first_errors"]})[:3],
        "p50_ms": med("p50_ms"),
        "p99_ms": med("p99_ms"),
        "elapsed_s": med("elapsed_s"),
        "memory": {
            k: mem(k)
            for k in ("swaps_in", "swaps_out", "bytes_in", "bytes_out", "swap_in_s", "recomputes")
        },
    }


# -- report ----------------------------------------------------------------------------
def render(doc: dict[str, Any]) -> str:
    out = [f"# Djinn memory pressure ({doc['scale']})", ""]
    busy = max(doc.get("load_before", 0), doc.get("load_after", 0))
    if busy > 1.0:
        out += [
            f"**Load average {busy:.1f} on {os.cpu_count()} CPUs around this run: other "
            "processes shared the machine; latencies are noisy, swap counts less so.**",
            "",
        ]
    a = doc["agents"][0]
    out.append(
        f"## Agents: {doc['args']['sessions']} sessions share one GPT-2-shaped model "
        f"({doc['args']['layers']} layers, width {doc['args']['width']}, "
        f"{a['weights_bytes'] / MiB:.0f} MiB); {doc['args']['rounds']} bursts of "
        f"{doc['args']['burst']} decode steps at a {doc['args']['context']}-token context, "
        f"think {doc['args']['think']} s; device {a['device_bytes'] / MiB:.0f} MiB = weights "
        f"+ ~3.3 caches of {a['kv_bytes_per_session'] / MiB:.1f} MiB; median of "
        f"{a['runs']} interleaved run(s) per policy"
    )
    out.append("")
    rows = []
    for r in doc["agents"]:
        m = r["memory"]
        gbps = m["bytes_in"] / m["swap_in_s"] / 1e9 if m.get("swap_in_s") else float("nan")
        rows.append(
            [
                r["policy"],
                f"{r['completed']}/{doc['args']['sessions']}",
                str(r["errors"]),
                f"{r['p50_ms']:.1f}",
                f"{r['p99_ms']:.1f}",
                str(m["swaps_in"]),
                str(m.get("recomputes", 0)),
                f"{(m['bytes_in'] + m['bytes_out']) / MiB:.0f}",
                f"{gbps:.2f} ({gbps / doc['memcpy_gbps']:.2f}x)" if m["swaps_in"] else "-",
                f"{r['elapsed_s']:.1f}",
            ]
        )
    out.append(
        md_table(
            [
                "policy",
                "completed",
                "errors",
                "step p50 ms",
                "step p99 ms",
                "swap-ins",
                "recomputes",
                "MiB moved",
                "swap-in GB/s (x memcpy)",
                "wall s",
            ],
            rows,
        )
    )
    out.append("")
    out.append(f"memcpy ceiling, same run: {doc['memcpy_gbps']:.2f} GB/s (goal: swap-in >= 0.7x)")
    out.append("")
    for r in doc["agents"]:
        for e in r.get("first_errors", []):
            out.append(f"- {r['policy']}: {e}")
    if any(r.get("first_errors") for r in doc["agents"]):
        out.append("")
    m0 = doc["many_models"][0]
    out.append(
        f"## Many models: 4 models of {m0['weights_bytes'][0] / MiB:.0f} MiB round-robin, "
        f"{doc['args']['mm_rounds']} rounds; device {m0['device_bytes'] / MiB:.0f} MiB "
        "(the weights are 2x of it)"
    )
    out.append("")
    rows = []
    for r in doc["many_models"]:
        ratio = r["load_build_ms"] / r["swap_in_ms"] if r["swap_in_ms"] == r["swap_in_ms"] else 0
        rows.append(
            [
                r["policy"],
                f"{r['calls']}",
                str(r["errors"]),
                f"{r['call_p50_ms']:.1f}",
                f"{r['swap_in_ms']:.1f}",
                f"{r['load_ms']:.1f}",
                f"{r['load_build_ms']:.1f}",
                f"{ratio:.1f}x",
                f"{r['host_peak'] / MiB:.0f} / {sum(r['weights_bytes']) / MiB:.0f}",
            ]
        )
    out.append(
        md_table(
            [
                "policy",
                "calls",
                "errors",
                "call p50 ms",
                "switch-in ms",
                "load_file ms (mmap)",
                "load+build ms",
                "load+build / switch",
                "host peak / all weights MiB",
            ],
            rows,
        )
    )
    out.append("")
    out.append(
        "switch-in: the appliance's swap-in time per model (arena -> device copy); "
        "load_file: safetensors' lazy (mmap) load of the same weights, page cache warm; "
        "load+build: the model built on meta and given materialised copies of them "
        "(goal: >= 10x). On a CPU worker both a switch and a load are memcpys from RAM, "
        "so the GPU goal (disk + H2D against pinned DMA) cannot show here. "
        "Host peak: at most one host copy per model, never one per client."
    )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke run (fewer, smaller)")
    p.add_argument("--full", action="store_true", help="GPT-2 small's width, 12 layers")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--repeats", type=int, default=2, help="agents runs per policy, interleaved")
    p.add_argument("--json", default="benchmarks/results/pressure.json")
    args = p.parse_args(argv)
    args.sessions, args.layers, args.width = 12, 6, 256
    args.context, args.burst, args.rounds, args.think = 256, 16, 3, 0.4
    args.mm_layers, args.mm_rounds = 6, 5
    if args.full:  # the sizes: GPT-2 small's shape, 512-token contexts
        args.layers, args.width, args.context = 12, 768, 512
    if args.quick:
        args.sessions, args.rounds, args.repeats = 6, 2, 1
        args.mm_layers, args.mm_rounds = 3, 3
    unwind_on_sigterm()
    torch.set_num_threads(1)  # the client is not the subject; leave the cores to the worker
    policies = [x for x in args.policies.split(",") if x]
    doc: dict[str, Any] = {
        "scale": "quick" if args.quick else "full" if args.full else "scaled for a 2-core CPU",
        "args": {k: v for k, v in vars(args).items() if k not in ("json", "policies")},
        "memcpy_gbps": memcpy_gbps(),
        "agents": [],
        "many_models": [],
    }
    doc["load_before"] = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        # interleaved, the order reversed every other repeat: drift on a shared machine
        # falls on every policy alike
        runs: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
        for k in range(args.repeats):
            for policy in policies if k % 2 == 0 else policies[::-1]:
                note(f"agents, {policy} (run {k + 1} of {args.repeats})")
                runs[policy].append(agents(policy, args, Path(tmp)))
        doc["agents_runs"] = runs
        doc["agents"] = [summarise(policy, rs) for policy, rs in runs.items()]
        for policy in [x for x in policies if x != "off"] or ["semantic"]:
            note(f"many models, {policy}")
            doc["many_models"].append(many_models(policy, args, Path(tmp)))
    doc["load_after"] = os.getloadavg()[0]
    print(render(doc))
    save_json(doc, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
