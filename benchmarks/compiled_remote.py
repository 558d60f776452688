#!/usr/bin/env python
"""``torch.compile`` of a module whose tensors are remote, against the same module run
plainly on the remote device, in the same run.

Dynamo cannot trace a remote tensor: it breaks its graph at each op that takes one and
runs the op as it is, which is Djinn's capture, as a plain call would. Before Note
[dynamo skips djinn] (djinn/frontend/dynamo_skip.py) it compiled the capture's own
Python too, into graphs run at every call. Measured, in turn in each round:

- plain: ``model(x).cpu()`` on remote tensors (the peer: what a compiled call should cost);
- compiled: ``torch.compile(model)(x).cpu()``, after its first two calls, each timed alone
  (compiled right after the move, the model's first call, as a user would);

with the graphs dynamo made (``unique_graphs``) and the largest difference between the
two. The model is an ``nn.Sequential`` of ``--layers`` Linear + ReLU of ``--width``.

    python benchmarks/compiled_remote.py
    python benchmarks/compiled_remote.py --layers 4 --calls 20

With DJINN_ADDRESS unset an embedded appliance is started.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from _common import note, save_json


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=1, help="Linear+ReLU pairs (default 1)")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--calls", type=int, default=10, help="timed calls per round")
    parser.add_argument("--repeat", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--json", default="benchmarks/results/compiled_remote.json")
    args = parser.parse_args()

    import torch._dynamo.utils

    import djinn  # noqa: F401  (the remote device)

    remote = "remote_accelerator:0"
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers).to(remote)
    x = torch.randn(8, args.width).to(remote)

    # compiled as a user would, right after the move: the first thing to run the model
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(model)
    start = time.perf_counter()
    first = compiled(x).cpu()
    first_s = time.perf_counter() - start
    start = time.perf_counter()
    compiled(x).cpu()  # dynamo checks its guards again, and may compile again
    second_s = time.perf_counter() - start
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    note(f"first compiled call {first_s:.2f} s, second {second_s:.3f} s, {graphs} graphs")

    def per_call(fn) -> float:
        start = time.perf_counter()
        for _ in range(args.calls):
            fn(x).cpu()
        return (time.perf_counter() - start) / args.calls

    rounds = [(per_call(model), per_call(compiled)) for _ in range(args.repeat)]
    plain_s = statistics.median(r[0] for r in rounds)
    compiled_s = statistics.median(r[1] for r in rounds)
    diff = (first - model(x).cpu()).abs().max().item()
    result = {
        "model": f"{args.layers} x (Linear {args.width} + ReLU)",
        "plain_ms": round(plain_s * 1e3, 2),
        "compiled_ms": round(compiled_s * 1e3, 2),
        "compiled_over_plain": round(compiled_s / plain_s, 3),
        "first_compiled_call_s": round(first_s, 2),
        "second_compiled_call_ms": round(second_s * 1e3, 1),
        "dynamo_graphs": graphs,
        "max_abs_diff": diff,
    }
    print(f"\n{result['model']}, {args.calls} calls x {args.repeat} rounds (medians)\n")
    print("| measure | value |\n|---|---|")
    print(f"| plain call on remote tensors (ms) | {result['plain_ms']} |")
    print(
        f"| torch.compile'd call (ms; / plain) | {result['compiled_ms']}; "
        f"{result['compiled_over_plain']} |"
    )
    print(f"| first compiled call (s) | {result['first_compiled_call_s']} |")
    print(f"| second compiled call (ms) | {result['second_compiled_call_ms']} |")
    print(f"| graphs dynamo compiled | {graphs} |")
    print(f"| max abs diff, compiled vs plain | {diff:.2e} |")
    save_json(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
