"""A fleet of 3 appliances: semantic placement vs round robin, and vs a single appliance.

Starts a local Ray cluster (a head and 2 worker nodes on this machine, each offering the
djinn_appliance resource, so 3 appliances with one CPU worker each) and 12 clients: 12
sessions on 12 TCP connections, from threads of this process, each registering one of 3
distinct GPT-2 models (random weights from GPT2Config; 4 clients per model, in a
shuffled order). Three phases, each with every session closed (and its weights freed)
before the next:

- single: all 12 sessions pinned to one appliance of the fleet (what one appliance does);
- semantic: sessions placed by the fleet's default policy;
- round_robin: sessions placed in turn.

Reported per phase: the weight memory the fleet holds once every client registered (and
the copies of each model), p50 / p99 of decode steps while all 12 clients decode at once
(prefill, then --steps steps, each reading its next token), and the time to place a
session: the directory's decision as the client waited for it, and the decision plus
connecting and opening the session on the chosen appliance.

    python benchmarks/fleet.py                  # GPT-2 small if memory allows (~8 min)
    python benchmarks/fleet.py --layers 2 --embd 128 --steps 8     # a quick look
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import torch
from _common import GiB, MiB, save_json
from _report import md_table

CLIENTS, MODELS = 12, 3
PHASES = ("single", "semantic", "round_robin")
TOKEN = "fleet-benchmark-token"
NODE = {"num_cpus": 1, "object_store_memory": 80 * MiB, "resources": {"djinn_appliance": 1}}


def note(msg: str) -> None:
    print(f"[fleet] {msg}", file=sys.stderr, flush=True)


def model_config(args: argparse.Namespace) -> Any:
    from transformers import GPT2Config

    return GPT2Config(n_layer=args.layers, n_embd=args.embd, n_head=args.heads)


def build_models(args: argparse.Namespace) -> list[Any]:
    from transformers import GPT2LMHeadModel

    models = []
    for seed in range(MODELS):
        torch.manual_seed(1000 + seed)  # distinct weights: distinct fingerprints
        models.append(GPT2LMHeadModel(model_config(args)).eval())
    return models


def shell_for(model: Any, session: Any) -> tuple[Any, dict[str, Any]]:
    """Register ``model`` with ``session`` and return a weightless (meta) twin whose calls
    go to that session by fingerprint: 12 clients share 3 local models."""
    from transformers import GPT2LMHeadModel

    from djinn.frontend import remote_module

    info = remote_module.register(model, session)
    with torch.device("meta"):
        shell = GPT2LMHeadModel(model.config).eval()
    device = torch.device("remote_accelerator", 0)
    shell._djinn = remote_module._RemoteBinding(info["fingerprint"], session, device, info)
    shell.__class__ = remote_module._remote_class(type(shell))
    return shell, info


def next_token(res: Any) -> torch.Tensor:
    """The greedy next token, chosen here from the fetched logits: ops on the remote logits
    would go to the process's default session (the graph path's), not to this client's."""
    logits = res.logits._ref.cpu()  # the output's RemoteTensor, read from its session
    return logits[:, -1].argmax(-1, keepdim=True)


def decode(shell: Any, prompt: torch.Tensor, steps: int, out: list[float]) -> None:
    res = shell(prompt, use_cache=True)
    nxt, past = next_token(res), res.past_key_values
    for _ in range(steps):
        t0 = time.perf_counter()
        res = shell(nxt, past_key_values=past, use_cache=True)
        nxt = next_token(res)  # the token is read each step, as a sampling loop would
        out.append(time.perf_counter() - t0)
        past = res.past_key_values


def wait_weights(fleet: Any, expect_models: int, timeout: float = 120.0) -> dict[str, Any]:
    """The fleet document once every model registered shows in some appliance's report
    and two reports in a row agree (the directory polls every fleet_report_interval)."""
    import ray

    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        doc = ray.get(fleet.snapshot.remote())
        fps = {m["fingerprint"] for a in doc["appliances"] for m in a.get("models", [])}
        key = sorted((a["id"], m["fingerprint"]) for a in doc["appliances"] for m in a["models"])
        if len(fps) >= expect_models and key == last:
            return doc
        last = key
        time.sleep(0.6)
    raise RuntimeError(f"the fleet never showed {expect_models} models")


def wait_empty(fleet: Any, timeout: float = 60.0) -> None:
    import ray

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        doc = ray.get(fleet.snapshot.remote())
        if not any(a.get("models") or a.get("sessions") for a in doc["appliances"]):
            return
        time.sleep(0.3)
    raise RuntimeError("sessions or models outlived their phase")


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


def run_phase(phase: str, fleet_addr: str, directory: Any, models: list[Any], args) -> dict:
    import ray

    from djinn.fleet.client import FleetClient

    policy = "semantic" if phase == "single" else phase
    ray.get(directory.set_placement.remote(policy))
    order = [i % MODELS for i in range(CLIENTS)]
    random.Random(args.seed).shuffle(order)
    client = FleetClient(fleet_addr, token=TOKEN)
    pinned = None
    if phase == "single":
        doc = ray.get(directory.snapshot.remote())
        pinned = sorted(a["id"] for a in doc["appliances"] if a["state"] == "up")[0]
    sessions, shells, place_s, open_s, register_s = [], [], [], [], []
    for m in order:  # one after another: each placement sees the ones before it
        s = client.session(appliance=pinned)
        t0 = time.perf_counter()
        shell, _ = shell_for(models[m], s)
        register_s.append(time.perf_counter() - t0)
        place_s.append(s.place_s)
        open_s.append(s.open_s)
        sessions.append(s)
        shells.append(shell)
    doc = wait_weights(directory, MODELS)
    copies = {}
    for a in doc["appliances"]:
        for mrow in a["models"]:
            copies[mrow["fingerprint"]] = copies.get(mrow["fingerprint"], 0) + 1
    weight = sum(m["bytes"] for a in doc["appliances"] for m in a["models"])
    lat: list[list[float]] = [[] for _ in shells]
    gen = torch.Generator().manual_seed(args.seed)
    vocab = models[0].config.vocab_size
    prompts = [torch.randint(0, vocab, (1, args.prompt), generator=gen) for _ in shells]
    start = threading.Barrier(len(shells))

    errors: list[BaseException] = []

    def client_thread(i: int) -> None:
        start.wait()
        try:
            decode(shells[i], prompts[i], args.steps, lat[i])
        except BaseException as exc:
            errors.append(exc)
            raise

    threads = [threading.Thread(target=client_thread, args=(i,)) for i in range(len(shells))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} client(s) failed: {errors[0]!r}")
    steps = [x for per in lat for x in per]
    per_appliance = {}
    for s in sessions:
        per_appliance[s.appliance] = per_appliance.get(s.appliance, 0) + 1
    for s in sessions:
        s.close()
    client.close()
    wait_empty(directory)
    return {
        "phase": phase,
        "weight_bytes": weight,
        "copies": sorted(copies.values()),
        "sessions_per_appliance": sorted(per_appliance.values(), reverse=True),
        "decode_p50_ms": 1e3 * statistics.median(steps),
        "decode_p99_ms": 1e3 * pct(steps, 0.99),
        "decode_steps": len(steps),
        "decode_wall_s": wall,
        "place_p50_ms": 1e3 * statistics.median(place_s),
        "place_p99_ms": 1e3 * pct(place_s, 0.99),
        "open_p50_ms": 1e3 * statistics.median(open_s),
        "open_p99_ms": 1e3 * pct(open_s, 0.99),
        "register_p50_s": statistics.median(register_s),
    }


def choose_size(args: argparse.Namespace) -> str:
    """Fall back to a smaller GPT-2 when this machine cannot hold round robin's copies
    (every model on every appliance, plus staging in each arena, plus the local models)."""
    from transformers import GPT2LMHeadModel

    with torch.device("meta"):
        n = sum(p.numel() for p in GPT2LMHeadModel(model_config(args)).parameters())
    need = 4 * n * (MODELS * MODELS + MODELS + 3) + 3 * GiB  # copies, local, arenas, slack
    free = psutil.virtual_memory().available
    if need > free and not args.no_fallback:
        note(f"{n / 1e6:.0f}M parameters need ~{need / GiB:.1f} GiB, {free / GiB:.1f} free")
        args.layers, args.embd, args.heads = 4, 384, 6
        return "smaller GPT-2 (4 layers, 384 wide): this machine cannot hold GPT-2 small's copies"
    return f"GPT-2 with {args.layers} layers, {args.embd} wide ({n / 1e6:.0f}M parameters)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--embd", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--prompt", type=int, default=16, help="prefill tokens per client")
    parser.add_argument("--steps", type=int, default=16, help="decode steps per client")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-fallback", action="store_true", help="never shrink the model")
    parser.add_argument("--json", default="benchmarks/results/fleet.json")
    args = parser.parse_args()
    import ray
    from ray.cluster_utils import Cluster

    from djinn import config as config_mod
    from djinn.fleet import cluster as fc

    size_note = choose_size(args)
    n_params = 0
    models = build_models(args)
    n_params = sum(p.numel() for p in models[0].parameters())
    model_bytes = 4 * n_params
    settings = {
        "token": TOKEN,
        "cpu_workers": 1,
        "arena_bytes": f"{max(256, 2 * model_bytes // MiB + 64)}MiB",
        "cpu_worker_memory": f"{MODELS * model_bytes // MiB + 512}MiB",
        "prewarm": True,
        "memory_policy": "off",  # every copy stays where it is: what we count is placement's
        "fleet_appliance_host": "127.0.0.1",
        "fleet_report_interval": 0.25,
        "heartbeat_misses": 30,  # 12 clients on 2 cores: a late heartbeat is not a death
    }
    with tempfile.TemporaryDirectory() as tmp:
        toml = Path(tmp) / "djinn.toml"
        toml.write_text(
            "".join(
                f"{k} = {str(v).lower() if isinstance(v, bool) else repr(v)}\n".replace("'", '"')
                for k, v in settings.items()
            )
        )
        cfg = config_mod.load(toml, env={})
    note(f"{size_note}; starting a local Ray cluster and 3 appliances")
    t0 = time.perf_counter()
    cluster = Cluster(initialize_head=True, head_node_args=NODE)
    try:
        for _ in range(2):
            cluster.add_node(**NODE)
        ray.init(address=cluster.address, namespace="djinn", log_to_driver=False)
        directory = fc.start_directory(cfg.to_dict(), TOKEN, detached=False)
        fc.wait_live(directory, 3, timeout=300)
        startup_s = time.perf_counter() - t0
        address = f"fleet://{cluster.address}"
        results = []
        for phase in PHASES:
            note(f"phase {phase}")
            results.append(run_phase(phase, address, directory, models, args))
        fc.stop_directory(directory)
    finally:
        ray.shutdown()
        cluster.shutdown()
    by = {r["phase"]: r for r in results}
    rows = []
    for r in results:
        rows.append(
            [
                r["phase"],
                f"{r['weight_bytes'] / MiB:.0f}",
                f"{r['weight_bytes'] / (MODELS * model_bytes):.2f}x",
                "/".join(map(str, r["copies"])),
                "/".join(map(str, r["sessions_per_appliance"])),
                f"{r['decode_p50_ms']:.1f}",
                f"{r['decode_p99_ms']:.1f}",
                f"{r['place_p50_ms']:.2f}",
                f"{r['place_p99_ms']:.2f}",
                f"{r['open_p50_ms']:.1f}",
            ]
        )
    headers = ["phase", "weights MiB", "vs one copy each", "copies per model",
               "sessions per appliance", "decode p50 ms", "decode p99 ms",
               "place p50 ms", "place p99 ms", "place+open p50 ms"]  # fmt: skip
    print(f"# Djinn fleet benchmark: {size_note}\n")
    print(
        f"{CLIENTS} clients, {MODELS} models of {model_bytes / MiB:.0f} MiB, 3 appliances "
        f"(1 CPU worker each) on {psutil.cpu_count()} CPUs; prompt {args.prompt} tokens, "
        f"{args.steps} decode steps per client, all clients at once\n"
    )
    print(md_table(headers, rows))
    sem, rr, one = by["semantic"], by["round_robin"], by["single"]
    print(
        f"\nround_robin holds {rr['weight_bytes'] / sem['weight_bytes']:.2f}x the weight "
        f"memory of semantic; semantic decode p50 / single appliance p50 = "
        f"{sem['decode_p50_ms'] / one['decode_p50_ms']:.2f}, p99 "
        f"{sem['decode_p99_ms'] / one['decode_p99_ms']:.2f} (on {psutil.cpu_count()} shared "
        f"CPUs, three CPU workers compete for the same cores); fleet start {startup_s:.0f} s"
    )
    doc = {
        "model": size_note,
        "model_bytes": model_bytes,
        "clients": CLIENTS,
        "phases": results,
        "startup_s": startup_s,
        "cpus": psutil.cpu_count(),
        "torch": torch.__version__,
        "ray": ray.__version__,
    }
    save_json(doc, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
