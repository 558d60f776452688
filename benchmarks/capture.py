"""Capture cost and remote-vs-local time for a GPT-2 forward.

Measures, in one run on one appliance:
- capture cost: µs per captured op while tracing a GPT-2 forward into LazyTensors with no
  execution (cold: first time each op signature is seen; warm: cached meta inference);
- end to end: remote forward (capture + ship + execute + fetch logits) against local eager.

    python benchmarks/capture.py [--layers 12] [--tokens 64] [--repeat 5] [--json PATH]

With DJINN_ADDRESS unset an embedded appliance is started. Design target: at most 20 µs
per captured op (warm).
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
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", default="benchmarks/results/capture.json")
    args = parser.parse_args()

    import transformers

    import djinn  # noqa: F401 - registers the remote device
    from djinn.frontend import trace

    cfg = transformers.GPT2Config(n_layer=args.layers)
    torch.manual_seed(0)
    local = transformers.GPT2LMHeadModel(cfg).eval()
    t0 = time.perf_counter()
    # moved in training mode so it stays on the graph path (an eval-mode transformers model
    # would register on the model path, where nothing is captured op by op), then eval
    remote = copy.deepcopy(local).train().to("remote_accelerator:0").eval()
    assert getattr(remote, "_djinn", None) is None, "expected the graph path"
    ids = torch.randint(0, cfg.vocab_size, (1, args.tokens))
    rids = ids.to("remote_accelerator:0")
    with torch.no_grad():
        remote(rids).logits.cpu()  # weights materialise as handles; warms the appliance
    upload_s = time.perf_counter() - t0
    n_params = sum(p.numel() for p in local.parameters())

    def capture_only() -> tuple[float, int]:
        tr = trace.current()
        tr.nodes.clear()
        start = time.perf_counter()
        with torch.no_grad():
            remote(rids)
        elapsed = time.perf_counter() - start
        n = len(tr.nodes)
        tr.nodes.clear()  # discard: nothing executes
        return elapsed, n

    from djinn.frontend import meta

    meta.clear_cache()
    cold_s, n_ops = capture_only()
    warm = [capture_only()[0] for _ in range(args.repeat)]
    warm_s = statistics.median(warm)

    def timed(fn) -> float:
        samples = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)

    with torch.no_grad():
        local_s = timed(lambda: local(ids).logits)
        remote_s = timed(lambda: remote(rids).logits.cpu())
        got = remote(rids).logits.cpu()
        want = local(ids).logits
    diff = (got - want).abs().max().item()

    result = {
        "model": f"GPT-2 {args.layers} layers ({n_params / 1e6:.0f}M params)",
        "tokens": args.tokens,
        "ops_per_forward": n_ops,
        "capture_us_per_op_cold": round(cold_s / n_ops * 1e6, 2),
        "capture_us_per_op_warm": round(warm_s / n_ops * 1e6, 2),
        "capture_ms_per_forward_warm": round(warm_s * 1e3, 2),
        "local_eager_ms": round(local_s * 1e3, 2),
        "remote_ms": round(remote_s * 1e3, 2),
        "remote_over_local": round(remote_s / local_s, 3),
        "max_abs_diff": diff,
        "weights_upload_s": round(upload_s, 2),
        "target_us_per_op": 20,
    }
    print(f"\n{result['model']}, {args.tokens} tokens, {n_ops} ops per forward\n")
    print("| measure | value |")
    print("|---|---|")
    print(f"| capture, cold (µs/op) | {result['capture_us_per_op_cold']} |")
    print(f"| capture, warm (µs/op) | {result['capture_us_per_op_warm']} (target ≤ 20) |")
    print(f"| capture per forward, warm (ms) | {result['capture_ms_per_forward_warm']} |")
    print(f"| local eager forward (ms) | {result['local_eager_ms']} |")
    print(f"| remote forward incl. capture + fetch (ms) | {result['remote_ms']} |")
    print(f"| remote / local | {result['remote_over_local']} |")
    print(f"| max abs diff vs local | {diff:.2e} |")
    print(f"| weights upload + first forward (s) | {result['weights_upload_s']} |\n")
    save_json(result, args.json)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
