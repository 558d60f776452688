"""A training loop on the graph path against local eager PyTorch (issue 11 §5).

A small ``nn.TransformerEncoder`` (``--layers`` layers of width ``--width``, a linear
head, MSE loss) trains for ``--steps`` Adam steps on fixed random batches, once locally
on the CPU and once on ``remote_accelerator:0`` from the same initial weights; both
loops end with the parameters read back (``.cpu()``), so the remote time includes every
step's capture, shipping and execution. Reported: seconds per loop (median of
``--repeat``), remote over local, the capture's share (ops captured per step), and the
largest parameter difference after the loop (the bar: 1e-5), beside its floor measured in
the same run: the difference between two local eager loops that differ only in the
number of intra-op threads (Adam amplifies float rounding of the gradients, and a
different summation order, or the math attention kernel the remote device dispatches
to instead of CPU flash attention, rounds differently).

    python benchmarks/training_step.py            # 20 steps, 3 repeats
    python benchmarks/training_step.py --steps 5 --repeat 1

With DJINN_ADDRESS unset an embedded appliance is started (one CPU worker). Goal
(issue 11): remote at most 1.20x local eager.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch
from _common import save_json
from _report import md_table

R = "remote_accelerator:0"


def build(width: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(
        width, nhead=4, dim_feedforward=2 * width, dropout=0.0, batch_first=True
    )
    return torch.nn.Sequential(
        torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False),
        torch.nn.Linear(width, 1),
    )


def loop(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]],
         device: str) -> tuple[float, list[torch.Tensor]]:  # fmt: skip
    """Train on ``batches`` (moved to ``device``); seconds, and the parameters after."""
    model = copy.deepcopy(model).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = [(x.to(device), y.to(device)) for x, y in batches]
    t0 = time.perf_counter()
    for x, y in data:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
    params = [p.detach().cpu() for p in model.parameters()]  # waits for every step
    return time.perf_counter() - t0, params


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", default="benchmarks/results/training_step.json")
    args = parser.parse_args()
    import djinn  # noqa: F401 - the remote_accelerator device

    model = build(args.width, args.layers).train()
    gen = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(args.batch, args.seq, args.width, generator=gen),
         torch.randn(args.batch, args.seq, 1, generator=gen))
        for _ in range(args.steps)
    ]  # fmt: skip
    loop(model, batches[:2], R)  # warm: the appliance's kernels, the meta caches
    loop(model, batches[:2], "cpu")
    local_s, remote_s, diffs = [], [], []
    for _ in range(args.repeat):
        took, want = loop(model, batches, "cpu")
        local_s.append(took)
        took, got = loop(model, batches, R)
        remote_s.append(took)
        diffs.append(max((g - w).abs().max().item() for g, w in zip(got, want, strict=True)))
    local, remote = statistics.median(local_s), statistics.median(remote_s)
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)
    _, other = loop(model, batches, "cpu")
    torch.set_num_threads(threads)
    floor = max((a - b).abs().max().item() for a, b in zip(other, want, strict=True))
    print(md_table(
        ["loop", "local eager s", "remote s", "remote / local", "max |param diff|",
         "local vs local, other thread count"],
        [[f"{args.steps} Adam steps, TransformerEncoder {args.layers}x{args.width}",
          f"{local:.3f}", f"{remote:.3f}", f"{remote / local:.2f}x", f"{max(diffs):.1e}",
          f"{floor:.1e}"]],
    ))  # fmt: skip
    print(f"\n(batch {args.batch} x {args.seq} tokens; medians of {args.repeat}; goal <= 1.20x)")
    save_json({"local_s": local_s, "remote_s": remote_s, "max_param_diff": max(diffs),
               "local_threads_diff": floor,
               "args": vars(args), "torch": torch.__version__}, args.json)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
