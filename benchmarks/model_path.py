"""Model path: GPT-2 prefill and decode steps, remote (by fingerprint) against local eager.

    python benchmarks/model_path.py [--layers 12] [--prefill 64] [--steps 16] [--json PATH]
    python benchmarks/model_path.py --layers 1 --width 64 --vocab 1000   # fixed overhead

Uses the default appliance (DJINN_ADDRESS, else an embedded one). Reports median latency
of a 64-token prefill and of single decode steps (KV cache kept on the appliance), the
ratio to local eager in the same run, and the bytes each call puts on the wire (which
must not grow with the context). Design targets: remote / local ≤ 1.10 on CPU workers;
decode bytes per step constant. A tiny model (``--width 64 --vocab 1000``) shows the fixed
cost of a call, what a GPU's fast forward leaves exposed: the step's remote - local, and
the worker's own time per request kind (its stats document) beside the client's.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time

import torch
from _common import save_json


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768, help="n_embd (heads: width / 64)")
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--prefill", type=int, default=64)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", default="benchmarks/results/model_path.json")
    args = parser.parse_args()
    import transformers

    import djinn  # noqa: F401 - the remote device

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=args.layers,
        n_embd=args.width,
        n_head=max(1, args.width // 64),
        vocab_size=args.vocab,
        bos_token_id=min(50256, args.vocab - 1),  # GPT-2's, inside a smaller vocabulary
        eos_token_id=min(50256, args.vocab - 1),
    )
    local = transformers.GPT2LMHeadModel(cfg).eval()
    t0 = time.perf_counter()
    model = copy.deepcopy(local).to("remote_accelerator:0")
    register_s = time.perf_counter() - t0
    channel = model._djinn.session.channel
    ids = torch.randint(0, cfg.vocab_size, (1, args.prefill))

    def wire() -> int:
        return channel.call_bytes()

    def remote_round() -> tuple[float, list[float], list[int], int]:
        b0 = wire()
        start = time.perf_counter()
        out = model(ids, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        nxt.cpu()
        prefill = time.perf_counter() - start
        prefill_bytes = wire() - b0
        steps, sizes = [], []
        past = out.past_key_values
        for _ in range(args.steps):
            b0, start = wire(), time.perf_counter()
            out = model(nxt, past_key_values=past, use_cache=True)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            nxt.cpu()  # the token is read each step, as a sampling loop would
            steps.append(time.perf_counter() - start)
            sizes.append(wire() - b0)
            past = out.past_key_values
        return prefill, steps, sizes, prefill_bytes

    def local_round() -> tuple[float, list[float]]:
        with torch.no_grad():
            start = time.perf_counter()
            out = local(ids, use_cache=True)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            prefill = time.perf_counter() - start
            steps, past = [], out.past_key_values
            for _ in range(args.steps):
                start = time.perf_counter()
                out = local(nxt, past_key_values=past, use_cache=True)
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                steps.append(time.perf_counter() - start)
                past = out.past_key_values
        return prefill, steps

    client = model._djinn.session.client

    def worker_seconds() -> dict[str, tuple[int, float]]:
        """(count, seconds) per request kind on the workers, from the stats document."""
        time.sleep(0.3)  # a worker pushes its stats at most every 0.1 s
        got: dict[str, tuple[int, float]] = {}
        for r in client.stats()["requests"]:
            if r["worker"] != "supervisor":
                n, t = got.get(r["kind"], (0, 0.0))
                got[r["kind"]] = (n + r["count"], t + r["sum_s"])
        return got

    remote_round()  # warm: hints cached, appliance warm
    local_round()
    served: dict[str, list[float]] = {}
    r_pre, r_step, l_pre, l_step, sizes, pre_bytes = [], [], [], [], [], 0
    for _ in range(args.repeat):  # interleaved rounds: both see the same machine
        before = worker_seconds()
        p, s, b, pb = remote_round()
        after = worker_seconds()
        for kind, (n, t) in after.items():
            n0, t0 = before.get(kind, (0, 0.0))
            if kind in ("CALL", "EXEC") and n > n0:
                served.setdefault(kind, []).append((t - t0) / (n - n0))
        r_pre.append(p)
        r_step += s
        sizes += b
        pre_bytes = pb
        p, s = local_round()
        l_pre.append(p)
        l_step += s
    med = statistics.median
    n_params = sum(p.numel() for p in local.parameters())
    result = {
        "model": f"GPT-2 {args.layers} layers, width {args.width}, vocabulary {args.vocab}",
        "prefill_tokens": args.prefill,
        "register_s": round(register_s, 2),
        "prefill_ms": {
            "remote": round(med(r_pre) * 1e3, 2),
            "local": round(med(l_pre) * 1e3, 2),
            "ratio": round(med(r_pre) / med(l_pre), 3),
        },
        "decode_ms": {
            "remote": round(med(r_step) * 1e3, 2),
            "local": round(med(l_step) * 1e3, 2),
            "ratio": round(med(r_step) / med(l_step), 3),
        },
        "decode_overhead_ms": round((med(r_step) - med(l_step)) * 1e3, 3),
        "worker_ms_per_request": {k: round(med(v) * 1e3, 3) for k, v in served.items()},
        "bytes": {
            "prefill_call": pre_bytes,
            "decode_step_min": min(sizes),
            "decode_step_max": max(sizes),
        },
        "targets": {"ratio_max": 1.10, "decode_bytes_constant": max(sizes) - min(sizes) <= 16},
    }
    print(
        f"\n{result['model']}, prefill {args.prefill} tokens, {args.steps} decode steps x "
        f"{args.repeat} (context {args.prefill}..{args.prefill + args.steps})\n"
    )
    print("| call | remote (ms) | local eager (ms) | remote / local | bytes on the wire |")
    print("|---|---|---|---|---|")
    print(
        f"| prefill | {result['prefill_ms']['remote']} | {result['prefill_ms']['local']} | "
        f"{result['prefill_ms']['ratio']} | {pre_bytes} |"
    )
    print(
        f"| decode step | {result['decode_ms']['remote']} | {result['decode_ms']['local']} | "
        f"{result['decode_ms']['ratio']} | {min(sizes)}..{max(sizes)} |"
    )
    print(
        f"\ndecode step remote - local: {result['decode_overhead_ms']} ms; the worker's mean "
        f"time per request (CALL: the model's call, EXEC: the sampling graph; prefill "
        f"included): {result['worker_ms_per_request']} ms"
    )
    print(
        f"\nregistration (fingerprint + upload of {n_params / 1e6:.0f}M "
        f"params): {register_s:.2f}s; target remote/local <= 1.10; decode bytes constant: "
        f"{result['targets']['decode_bytes_constant']}\n"
    )
    save_json(result, args.json)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
