#!/usr/bin/env python
"""The CUDA paths against local GPU eager and the copy engine's ceiling, in one run.

Needs a CUDA device (exits 2 without one). Starts a private appliance (``djinn serve``,
``gpus = "auto"``: one worker per GPU, the host arena page-locked), then measures, each
beside its ceiling or peer taken in the same run:

- **upload**: a put of ``--upload`` bytes through the arena into device memory (client
  memcpy into the shared arena, then the worker's DMA from it) against the same bytes
  copied host-to-device from pinned memory in this process (``cudaMemcpy``'s ceiling),
  and against a pageable host-to-device copy; a get the same way back;
- **VMU**: the appliance's device figures (its accounted ``used`` and the worker's CUDA
  allocator; the card's ``free``/``total``) against ``torch.cuda.mem_get_info`` in this
  process and NVML, before and after a model is loaded;
- **model path**: a GPT-2 (``--layers``) prefill of ``--prefill`` tokens and single decode
  steps (KV cache kept on the appliance), remote against the same model on this GPU;
- **graph path**: the same GPT-2's forward captured op by op and replayed by
  ``djinn.replayable``, and a 20-step Adam loop of a small ``nn.TransformerEncoder``
  (captured; and ``Adam(capturable=True)`` replayed), remote against local GPU eager, with
  the largest difference from local of the logits and of the parameters after the loop
  (the captured loop also against a local loop whose attention is the math kernel's).

    python benchmarks/gpu.py                 # GPT-2 small
    python benchmarks/gpu.py --layers 48 --width 1600 --heads 25   # GPT-2 XL's shape

Every ratio is remote over local (lower is better) except the copy rates (djinn over
ceiling: higher is better). Prints markdown tables and writes ``--json``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _appliance import appliance, device_of, unwind_on_sigterm
from _common import GiB, MiB, note, save_json
from training_step import batches_of, max_diff, using
from training_step import build as build_encoder

R = "remote_accelerator:0"


def timed(fn: Callable[[], Any]) -> float:
    """Seconds of ``fn()``; the local GPU's queue drained before and after."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def host_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(0),
        "gpus": torch.cuda.device_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }
    with contextlib.suppress(Exception):
        import pynvml

        pynvml.nvmlInit()
        driver = pynvml.nvmlSystemGetDriverVersion()
        info["driver"] = driver.decode() if isinstance(driver, bytes) else driver
    return info


def upload(session: Any, nbytes: int, repeat: int) -> dict[str, Any]:
    """Put and get of ``nbytes`` through the appliance against local copies of the same
    bytes: pinned host -> device (the DMA ceiling), pageable host -> device, and back."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    pinned = src.pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    back = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    (remote,) = session.put_many([src])  # warm: slabs leased, the worker's copy path
    assert torch.equal(session.get_many([remote])[0], src), "put/get changed the bytes"
    remote.free()
    put, get, h2d, h2d_pageable, d2h = [], [], [], [], []
    for _ in range(repeat):  # interleaved: each sees the same machine
        start = time.perf_counter()
        (remote,) = session.put_many([src])
        put.append(time.perf_counter() - start)
        start = time.perf_counter()
        session.get_many([remote])
        get.append(time.perf_counter() - start)
        remote.free()
        h2d.append(timed(lambda: dev.copy_(pinned, non_blocking=True)))
        h2d_pageable.append(timed(lambda: dev.copy_(src)))
        d2h.append(timed(lambda: back.copy_(dev, non_blocking=True)))
    gbps = lambda s: round(nbytes / statistics.median(s) / 1e9, 2)  # noqa: E731
    return {
        "bytes": nbytes,
        "put_gbps": gbps(put),
        "pinned_h2d_gbps": gbps(h2d),
        "pageable_h2d_gbps": gbps(h2d_pageable),
        "put_over_pinned_h2d": round(gbps(put) / gbps(h2d), 3),
        "get_gbps": gbps(get),
        "pinned_d2h_gbps": gbps(d2h),
        "get_over_pinned_d2h": round(gbps(get) / gbps(d2h), 3),
    }


def vmu_figures(client: Any, worker: int = 0) -> dict[str, Any]:
    """The appliance's view of GPU ``worker`` beside this process's and NVML's."""
    time.sleep(0.3)  # a fresh stats report from the worker (sent every 0.1 s when busy)
    doc = client.stats()
    w = next(x for x in doc["workers"] if x["id"] == worker)
    dev = next(d for d in doc["vmu"]["devices"] if d["worker"] == worker)
    used = sum(dev[s]["used"] for s in ("text", "data", "stack"))
    figures = w.get("device_memory") or {}
    free, total = torch.cuda.mem_get_info(0)
    out = {
        "vmu_used": used,
        "vmu_capacity": dev["text"]["capacity"],
        "worker_allocated": figures.get("allocated"),
        "worker_reserved": figures.get("reserved"),
        "worker_free": figures.get("free"),
        "worker_total": figures.get("total"),
        "here_free": free,
        "here_total": total,
        "nvml_used": w.get("gpu_memory_used"),
        "nvml_total": w.get("gpu_memory_total"),
    }
    if figures.get("allocated"):
        out["vmu_used_over_allocated"] = round(used / figures["allocated"], 4)
    if figures.get("free"):
        out["worker_free_over_here_free"] = round(figures["free"] / free, 4)
    if w.get("gpu_memory_used"):
        out["nvml_used_over_total_minus_free"] = round(w["gpu_memory_used"] / (total - free), 4)
    return out


def model_path(local: torch.nn.Module, vocab: int, prefill: int, steps: int,
               repeat: int) -> dict[str, Any]:  # fmt: skip
    """Prefill and decode steps, remote (model path, by fingerprint) against this GPU."""
    start = time.perf_counter()
    remote = copy.deepcopy(local).to(R)  # eval mode: registered whole
    register_s = time.perf_counter() - start
    assert getattr(remote, "_djinn", None) is not None, "expected the model path"
    gpu = local.cuda()
    ids = torch.randint(0, vocab, (1, prefill))

    def run(model: torch.nn.Module, x: torch.Tensor) -> tuple[float, list[float], Any]:
        with torch.no_grad():
            t0 = time.perf_counter()
            out = model(x, use_cache=True)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True).cpu()  # read, as sampling does
            pre, logits, times, past = time.perf_counter() - t0, out.logits, [], out.past_key_values
            for _ in range(steps):
                t0 = time.perf_counter()
                out = model(nxt.to(x.device), past_key_values=past, use_cache=True)
                nxt = out.logits[:, -1].argmax(-1, keepdim=True).cpu()
                times.append(time.perf_counter() - t0)
                past = out.past_key_values
        return pre, times, logits

    run(remote, ids)
    run(gpu, ids.cuda())  # warm both
    r_pre, r_step, l_pre, l_step = [], [], [], []
    for _ in range(repeat):
        p, s, got = run(remote, ids)
        r_pre.append(p)
        r_step += s
        p, s, want = run(gpu, ids.cuda())
        l_pre.append(p)
        l_step += s
    med = statistics.median
    diff = (got.cpu() - want.cpu()).abs().max().item()
    return {
        "register_s": round(register_s, 2),
        "prefill_tokens": prefill,
        "prefill_ms": [round(med(r_pre) * 1e3, 2), round(med(l_pre) * 1e3, 2)],
        "prefill_ratio": round(med(r_pre) / med(l_pre), 3),
        "decode_ms": [round(med(r_step) * 1e3, 3), round(med(l_step) * 1e3, 3)],
        "decode_ratio": round(med(r_step) / med(l_step), 3),
        "max_abs_diff_logits": diff,
        "remote": remote,
    }


def graph_forward(local: torch.nn.Module, vocab: int, tokens: int, repeat: int,
                  client: Any) -> dict:  # fmt: skip
    """The forward captured op by op (moved in training mode, so not registered), and the
    same forward replayed by ``djinn.replayable`` (no op captured; the worker runs the kept
    graph by its plan, compiled after ``graph_compile_after`` runs), each against this GPU
    in the same rounds."""
    import djinn

    remote = copy.deepcopy(local).cpu().train().to(R).eval()
    assert getattr(remote, "_djinn", None) is None, "expected the graph path"
    ids = torch.randint(0, vocab, (1, tokens))
    rids, gids = ids.to(R), ids.cuda()
    gpu = local.cuda()
    replayed = djinn.replayable(lambda x: remote(x).logits)
    with torch.no_grad():
        remote(rids).logits.cpu()
        gpu(gids).logits.cpu()  # warm both
        for _ in range(replayed.after + 3):  # recorded, confirmed, replayed, compiled
            replayed(rids).cpu()
        fresh = [torch.randint(0, vocab, (1, tokens)) for _ in range(repeat)]
        rounds = [
            (
                timed(lambda: remote(rids).logits.cpu()),
                timed(lambda: gpu(gids).logits.cpu()),
                timed(lambda: replayed(rids).cpu()),
                # new ids each call, uploaded by both (a CUDA graph copies them in)
                timed(lambda: replayed(new.to(R)).cpu()),  # noqa: B023 - called at once
                timed(lambda: gpu(new.cuda()).logits.cpu()),  # noqa: B023
            )
            for new in fresh
        ]
        want = gpu(gids).logits.cpu()
        diff = (remote(rids).logits.cpu() - want).abs().max().item()
        replay_diff = (replayed(rids).cpu() - want).abs().max().item()
        # a replay runs the captured forward's kernels: the same bits (CUDA graphs too)
        replay_bits = torch.equal(replayed(rids).cpu(), remote(rids).logits.cpu())
    r, g, p, pn, gn = (statistics.median(x[i] for x in rounds) for i in range(5))
    time.sleep(1.5)  # the worker's stats reach the supervisor every worker_stats.STATS_PUSH_S
    return {
        "tokens": tokens,
        "ms": [round(r * 1e3, 2), round(g * 1e3, 2)],
        "ratio": round(r / g, 3),
        "max_abs_diff_logits": diff,
        "replayed_ms": round(p * 1e3, 2),
        "replayed_ratio": round(p / g, 3),
        "replayed_max_abs_diff_logits": replay_diff,
        "replayed_equals_captured": replay_bits,
        "replayed_new_ids_ms": [round(pn * 1e3, 2), round(gn * 1e3, 2)],
        "replayed_new_ids_ratio": round(pn / gn, 3),
        "replay": replayed.stats(),
        "plans": client.stats()["scheduler"][0]["graph_plans"],
        "cuda_graphs": client.stats()["scheduler"][0]["cuda_graphs"],
    }


DROPOUT = 0.1  # the dropout loops': what nn.TransformerEncoderLayer, BERT and GPT-2 default to


def training_batches(steps: int, loop: str) -> tuple[torch.nn.Module, list]:
    """The encoder and batches of a training loop (``LOCAL_LOOPS``, ``REMOTE_LOOPS``): with
    ``DROPOUT`` for a loop whose name says so."""
    dropout = DROPOUT if "dropout" in loop else 0.0
    return build_encoder(64, 2, dropout).train(), batches_of(64, steps)


LOCAL_LOOPS = {  # name: (optimizer, attention kernels of the local loop or None for any)
    "adam": ("adam", None),
    "adam_math": ("adam", "math"),
    "capturable": ("capturable", None),
    "sgd": ("sgd", None),
    "adam_dropout": ("adam", None),  # the model with DROPOUT
}
# the remote loops: name, optimizer, replayed by djinn.replayable, local loop compared with
REMOTE_LOOPS = (
    ("adam", "adam", False, "adam"),
    ("capturable", "capturable", True, "capturable"),
    ("adam_replayed", "adam", True, "adam"),
    ("sgd_replayed", "sgd", True, "sgd"),
    # Note [replayed draws]: a GPU worker seeds CUDA's generator from the client's CPU
    # state, so its draws are not local GPU eager's: the parameters differ by the masks
    ("adam_dropout", "adam", True, "adam_dropout"),
)


def local_training_child(repeat: int, steps: int, out: str) -> int:
    """The local GPU eager loops, in a process that never imported djinn: once a PrivateUse1
    device is registered, PyTorch routes every CUDA backward's stream bookkeeping to it and
    the engine asserts (``opt_ready_stream && opt_parent_stream``, pytorch#161129), so a
    process that imported djinn cannot train on its local GPU (seen on an H200).

    ``adam_math`` is the default loop with attention restricted to the math kernel: the
    remote device captures attention as the math kernel's ops, while local CUDA eager
    picks a fused kernel for float32, so the two are compared to tell a kernel choice from
    a wrong number."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from training_step import loop, steady

    result = {}
    for name, (optimizer, kernels) in LOCAL_LOOPS.items():
        model, batches = training_batches(steps, name)
        scope = sdpa_kernel(SDPBackend.MATH) if kernels else contextlib.nullcontext()
        with scope:
            loop(model, batches[:2], "cuda", optimizer)  # warm
            times, params, per_step = [], [], []
            for _ in range(repeat):
                took, params = loop(model, batches, "cuda", optimizer)
                times.append(took)
                per_step.append(steady())
        result[name] = {"times": times, "params": params, "per_step": per_step}
    torch.save(result, out)
    return 0


def training(repeat: int, client: Any, steps: int = 20) -> dict[str, Any]:
    """training_step.py's loop (a 2-layer encoder of width 64), remote and on this GPU in a
    child process (``local_training_child``); the parameters after the loop compared (a
    GPU's kernels round differently from a CPU's, so local GPU eager is the reference
    here). The remote loops (``REMOTE_LOOPS``): Adam captured step by step, and four
    replayed by ``djinn.replayable`` (issue 11's training target): ``Adam(capturable=True)``,
    the default Adam (its steps followed beside the replayed forward and backward), SGD
    (momentum 0.9), and the default Adam on the model with dropout (its draws replayed,
    Note [replayed draws]; a random op keeps its plan from a CUDA graph). Each replayed
    loop reports its seconds per steady step (past the first call and the recordings,
    ``training_step.steady``) beside local eager's, and each loop what the worker's CUDA
    graphs did meanwhile (Note [a graph that writes its inputs])."""
    import subprocess

    import training_step
    from training_step import loop

    def graphs() -> dict[str, int]:
        time.sleep(0.5)  # the worker's stats reach the supervisor every STATS_PUSH_S
        return client.stats()["scheduler"][0]["cuda_graphs"]

    remote: dict[str, tuple[list[float], list[torch.Tensor], list[float]]] = {}
    cuda_graphs: dict[str, dict[str, int]] = {}
    for name, optimizer, replay, _ in REMOTE_LOOPS:
        model, batches = training_batches(steps, name)
        before = graphs()
        loop(model, batches[:2], R, optimizer)  # warm
        times, got, per_step = [], [], []
        for _ in range(repeat):
            took, got = loop(model, batches, R, optimizer, replay=replay)
            times.append(took)
            per_step.append(training_step.steady())
        remote[name] = (times, got, per_step)
        after = graphs()
        cuda_graphs[name] = {
            k: after[k] - before[k] for k in ("captured", "replays", "failed", "refused")
        }
        why, was = after.get("why", {}), before.get("why", {})
        cuda_graphs[name]["why"] = {
            k: n - was.get(k, 0) for k, n in why.items() if n > was.get(k, 0)
        }
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "local.pt")
        subprocess.run(
            [sys.executable, __file__, "--local-training-child", out, "--repeat", str(repeat)],
            check=True, timeout=150,
        )  # fmt: skip
        local = torch.load(out)  # this benchmark's own child wrote it
    med = statistics.median
    loops = {}
    for name, _, replay, against in REMOTE_LOOPS:
        r, g = med(remote[name][0]), med(local[against]["times"])
        row = {
            "replayed": replay,
            "s": [round(r, 3), round(g, 3)],
            "ratio": round(r / g, 3),
            "max_param_diff": max_diff(remote[name][1], local[against]["params"]),
            "cuda_graphs": cuda_graphs[name],
        }
        if replay:
            rs, gs = med(remote[name][2]), med(local[against]["per_step"])
            row["per_step_ms"] = [round(rs * 1e3, 3), round(gs * 1e3, 3)]
            row["per_step_ratio"] = round(rs / gs, 3)
        loops[name] = row
    return {
        "steps": steps,
        "loops": loops,
        "max_param_diff_math_attention": max_diff(remote["adam"][1], local["adam_math"]["params"]),
        "local_math_attention_s": round(med(local["adam_math"]["times"]), 3),
        "replays": training_step.REPLAYS[-sum(r for _, _, r, _ in REMOTE_LOOPS) * repeat :],
        "local_in": "a child process without djinn (pytorch#161129)",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64, help="graph-path forward tokens")
    parser.add_argument("--upload", default="256MiB", help="bytes of the upload test")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--arena", default="4GiB")
    parser.add_argument("--json", default="benchmarks/results/gpu.json")
    parser.add_argument("--sections", default=None,
                        help="comma-separated sections to run (default: all): vmu_before, "
                             "upload, model_path, vmu_loaded, graph_forward, training, "
                             "no_cuda_graphs")  # fmt: skip
    parser.add_argument("--local-training-child", metavar="OUT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    wanted = set(args.sections.split(",")) if args.sections else None
    if args.local_training_child:
        return local_training_child(max(1, args.repeat), 20, args.local_training_child)
    if not torch.cuda.is_available():
        print("gpu.py needs a CUDA device; none is visible", file=sys.stderr)
        return 2
    import transformers

    import djinn  # noqa: F401 - the remote device
    from djinn.config import parse_bytes
    from djinn.runtime.client import Client

    unwind_on_sigterm()
    doc: dict[str, Any] = {"benchmark": "gpu", "host": host_info()}
    note(f"host: {doc['host']}")
    with tempfile.TemporaryDirectory() as tmp, appliance(
        Path(tmp), parse_bytes(args.arena), "auto"
    ) as app, using(app.unix), Client(app.unix) as client:  # fmt: skip
        doc["appliance_device"] = device_of(app.readiness)
        stats = client.stats()
        doc["workers"] = len(stats["workers"])
        doc["arena_pinned"] = stats["vmu"]["host_arena"]["pinned"]
        torch.manual_seed(0)
        cfg = transformers.GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=args.heads)
        local = transformers.GPT2LMHeadModel(cfg).eval()
        n_params = sum(p.numel() for p in local.parameters())
        doc["model"] = f"GPT-2 {args.layers} layers, width {args.width} ({n_params / 1e6:.0f}M)"
        keep: list[Any] = []  # the registered model stays until the VMU figures are read

        def upload_section() -> dict[str, Any]:
            with client.session() as s:
                return upload(s, parse_bytes(args.upload), args.repeat)

        def model_section() -> dict[str, Any]:
            mp = model_path(local, cfg.vocab_size, args.prefill, args.steps, args.repeat)
            keep.append(mp.pop("remote"))
            return mp

        sections = [
            ("vmu_before", lambda: vmu_figures(client)),
            ("upload", upload_section),
            ("model_path", model_section),
            ("vmu_loaded", lambda: vmu_figures(client)),
            ("graph_forward", lambda: graph_forward(local, cfg.vocab_size, args.tokens,
                                                    args.repeat, client)),
            ("training", lambda: training(max(1, args.repeat // 2), client)),
        ]  # fmt: skip
        for name, section in sections:
            if wanted is not None and name not in wanted:
                continue
            # one section's failure is a finding, reported with the others' figures
            note(f"{name} ({doc['model']})" if name == "model_path" else name)
            try:
                doc[name] = section()
            except Exception as exc:  # reported, and the run goes on
                doc[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
                note(f"{name} failed: {doc[name]['error']}")
            save_json(doc, args.json)  # what is measured survives a later section's limit
        keep.clear()
    # the replayed forward once more, on an appliance whose plans are not CUDA graphs
    # (Note [CUDA graphs for plans]): what the graphs buy, same machine, same run
    if wanted is None or "no_cuda_graphs" in wanted:
        note("graph_forward without CUDA graphs")
        try:
            with tempfile.TemporaryDirectory() as tmp, appliance(
                Path(tmp), parse_bytes(args.arena), "auto", cuda_graphs=False
            ) as app, using(app.unix), Client(app.unix) as client:  # fmt: skip
                doc["graph_forward_no_cuda_graphs"] = graph_forward(
                    local, cfg.vocab_size, args.tokens, args.repeat, client
                )
                save_json(doc, args.json)
                note("training without CUDA graphs")
                doc["training_no_cuda_graphs"] = training(max(1, args.repeat // 2), client)
        except Exception as exc:  # reported with the other sections
            name = "training" if "graph_forward_no_cuda_graphs" in doc else "graph_forward"
            doc[f"{name}_no_cuda_graphs"] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
    save_json(doc, args.json)
    report(doc)
    save_json(doc, args.json)
    print(json.dumps(doc))
    return 0


def report(doc: dict[str, Any]) -> None:
    """Markdown tables of what ran; a failed section is named with its error instead."""
    ok = lambda name: isinstance(doc.get(name), dict) and "error" not in doc[name]  # noqa: E731
    for name, value in doc.items():
        if isinstance(value, dict) and "error" in value:
            print(f"\n**{name} failed**: {value['error']}")
    h = doc["host"]
    print(f"\n{h['gpu']} (driver {h.get('driver', '?')}, CUDA {h['cuda']}, torch {h['torch']});"
          f" appliance: {doc['workers']} worker(s) on {doc['appliance_device']}, arena pinned:"
          f" {doc['arena_pinned']}\n")  # fmt: skip
    if ok("upload"):
        up = doc["upload"]
        mib = up["bytes"] // MiB
        print("| copy | djinn (GB/s) | ceiling, same run (GB/s) | djinn / ceiling |")
        print("|---|---|---|---|")
        print(f"| put {mib} MiB (arena -> device) | {up['put_gbps']} | pinned H2D "
              f"{up['pinned_h2d_gbps']} (pageable {up['pageable_h2d_gbps']}) | "
              f"{up['put_over_pinned_h2d']} |")  # fmt: skip
        print(f"| get {mib} MiB (device -> arena) | {up['get_gbps']} | pinned D2H "
              f"{up['pinned_d2h_gbps']} | {up['get_over_pinned_d2h']} |")  # fmt: skip
    print(f"\n{doc['model']}\n")
    print("| call | remote (ms) | local GPU eager (ms) | remote / local | max abs diff |")
    print("|---|---|---|---|---|")
    if ok("model_path"):
        mp = doc["model_path"]
        print(f"| model path: prefill {mp['prefill_tokens']} | {mp['prefill_ms'][0]} | "
              f"{mp['prefill_ms'][1]} | {mp['prefill_ratio']} | "
              f"{mp['max_abs_diff_logits']:.1e} |")  # fmt: skip
        print(f"| model path: decode step | {mp['decode_ms'][0]} | {mp['decode_ms'][1]} | "
              f"{mp['decode_ratio']} | |")  # fmt: skip
    if ok("graph_forward"):
        gf = doc["graph_forward"]
        print(f"| graph path: forward, {gf['tokens']} tokens | {gf['ms'][0]} | {gf['ms'][1]} | "
              f"{gf['ratio']} | {gf['max_abs_diff_logits']:.1e} |")  # fmt: skip
        print(f"| graph path: the same forward replayed | {gf['replayed_ms']} | {gf['ms'][1]} "
              f"| {gf['replayed_ratio']} | {gf['replayed_max_abs_diff_logits']:.1e} (the "
              f"captured forward's bits: {gf['replayed_equals_captured']}) |")  # fmt: skip
    if ok("graph_forward") and "replayed_new_ids_ms" in doc["graph_forward"]:
        gf = doc["graph_forward"]
        ms = gf["replayed_new_ids_ms"]
        print(f"| graph path: replayed, new ids each call (uploaded by both) | {ms[0]} | {ms[1]} "
              f"| {gf['replayed_new_ids_ratio']} | |")  # fmt: skip
    if ok("graph_forward_no_cuda_graphs"):
        nf = doc["graph_forward_no_cuda_graphs"]
        print(f"| graph path: replayed, `cuda_graphs = false` (another appliance) | "
              f"{nf['replayed_ms']} | {nf['ms'][1]} | {nf['replayed_ratio']} | "
              f"{nf['replayed_max_abs_diff_logits']:.1e} |")  # fmt: skip
    for section, where in (
        ("training", ""),
        ("training_no_cuda_graphs", ", `cuda_graphs = false`"),
    ):
        if ok(section):
            training_rows(doc[section], where)
    if ok("graph_forward"):
        print(
            f"\nworker 0's plans: {doc['graph_forward']['plans']}; CUDA graphs: "
            f"{doc['graph_forward']['cuda_graphs']}"
        )
    if ok("model_path"):
        print(f"\nregistration of the model: {doc['model_path']['register_s']} s")
    print("\n| VMU | before load | after load |")
    print("|---|---|---|")
    before, after = doc.get("vmu_before") or {}, doc.get("vmu_loaded") or {}
    fmt = lambda v: f"{v / GiB:.3f} GiB" if isinstance(v, int) and v > MiB else str(v)  # noqa: E731
    for key in dict.fromkeys([*before, *after]):
        print(f"| {key} | {fmt(before.get(key))} | {fmt(after.get(key))} |")


def training_rows(tr: dict[str, Any], where: str) -> None:
    """The training section's rows of the report's table."""
    titles = {
        "adam": f"{tr['steps']}-step Adam loop, captured",
        "capturable": "the same, `Adam(capturable=True)` replayed",
        "adam_replayed": "the same, default Adam replayed",
        "sgd_replayed": "the same, SGD replayed (against local SGD)",
        "adam_dropout": f"the same with dropout {DROPOUT}, default Adam replayed (other draws)",
    }
    for name, row in tr["loops"].items():
        extra = ""
        if name == "adam":
            extra = (f"; {tr['max_param_diff_math_attention']:.1e} against local with math"
                     f" attention, {tr['local_math_attention_s']} s")  # fmt: skip
        if "per_step_ms" in row:
            ps = row["per_step_ms"]
            extra += f"; steady step {ps[0]} ms / {ps[1]} ms = {row['per_step_ratio']}x"
        graphs = row["cuda_graphs"]
        extra += "; CUDA graphs " + ", ".join(f"{k} {v}" for k, v in graphs.items() if k != "why")
        if graphs.get("why"):
            extra += f" ({graphs['why']})"
        title = f"{titles.get(name, name)}{where}"
        print(f"| graph path: {title} (s) | {row['s'][0]} | {row['s'][1]} | {row['ratio']} | "
              f"{row['max_param_diff']:.1e} (params{extra}) |")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
