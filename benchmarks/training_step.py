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

The remote loop runs on five private appliances (``djinn serve``, one CPU worker
each): the defaults, where the worker runs a repeated step by its execution plan,
compiled (Note [graph plans], Note [compiled plans]); ``graph_compile_after = 0``, where
the plan runs op by op; ``graph_plan_after = 0``, where it interprets every step op by op;
``cpu_wait_policy = inherit``, where the worker's idle OpenMP threads spin as long as the
runtime's own default (Note [idle OpenMP threads]); and ``cpu_threads_beside_client =
true``, where a graph the client sent without waiting for it runs with one thread fewer
(Note [a capturing client beside its worker]: its parameters are then local eager's at
that thread count, which the last column measures). Repeats interleave local and the
remote loops, so all see the same machine. Goal (issue 11): remote at most 1.20x local eager.

The replay rows run the step as a ``djinn.replayable`` function (Note [replayable
functions]) on the first appliance: with the default Adam, whose bias corrections are
Python floats that change every step, so its step runs at every call, followed against
the recording's and sent with the forward and backward as one graph (Note [followed
steps]; the replay stats printed with the table say how many); with
``Adam(capturable=True)``, whose step counts and corrections stay on the
device, against the same loop captured op by op (bit for bit: PyTorch has no capturable
Adam on the CPU to compare with); and with SGD (momentum 0.9) against local eager SGD.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from _appliance import appliance
from _common import GiB, save_json
from _report import md_table

R = "remote_accelerator:0"


def build(width: int, layers: int, dropout: float = 0.0) -> torch.nn.Module:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(
        width, nhead=4, dim_feedforward=2 * width, dropout=dropout, batch_first=True
    )
    return torch.nn.Sequential(
        torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False),
        torch.nn.Linear(width, 1),
    )


OPTIMIZERS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
    "capturable": lambda ps: torch.optim.Adam(ps, lr=1e-3, capturable=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    "foreach": lambda ps: torch.optim.Adam(ps, lr=1e-3, foreach=True),
}
REPLAYED = ("adam", "capturable", "sgd")  # the optimizers of the replay table
REPLAYS: list[dict] = []  # each replayed loop's stats(), for the report
CALLS: list[float] = []  # when each call of the last loop returned
STEADY_FROM = 3  # the calls before it: the first, and the two recordings of a replay


def batches_of(width: int, count: int, batch: int = 16, seq: int = 32) -> list[tuple]:
    """``count`` fixed random (input, target) batches for ``build(width, ...)``."""
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(batch, seq, width, generator=gen), torch.randn(batch, seq, 1, generator=gen))
        for _ in range(count)
    ]


def add_worker_threads(parser: argparse.ArgumentParser) -> None:
    """``--worker-threads N``, as followed_steps.py and replay_ahead.py take it."""
    parser.add_argument("--worker-threads", type=int, default=0,
                        help="the CPU worker's and local eager's intra-op threads "
                             "(0: the worker's default, local eager's own)")  # fmt: skip


def worker_threads(n: int) -> dict[str, int]:
    """The appliance settings for ``--worker-threads n`` (local eager takes n too)."""
    if not n:
        return {}
    torch.set_num_threads(n)
    return {"cpu_threads": n}


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> Callable:
    """One step of this benchmark's loop: MSE loss, backward, the optimizer's step."""

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def steady() -> float:
    """Seconds per step of the last loop from call STEADY_FROM + 1 to the last call
    (between their returns): past a replay's first call and recordings, and past local
    eager's first step, which allocates its state."""
    return (CALLS[-1] - CALLS[STEADY_FROM - 1]) / (len(CALLS) - STEADY_FROM)


def loop(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]],
         device: str, optimizer: str = "adam", replay: bool = False,
         inside: bool = False) -> tuple[float, list[torch.Tensor]]:  # fmt: skip
    """Train on ``batches`` (moved to ``device`` before the loop, or ``inside`` it, step
    by step, as a program reading a data loader does); seconds, and the parameters after.
    Djinn is imported only to replay: gpu.py's local CUDA loop runs here in a process that
    must not import it (pytorch#161129, see gpu.py's ``local_training_child``)."""
    model = copy.deepcopy(model).to(device)
    opt = OPTIMIZERS[optimizer](model.parameters())
    data = batches if inside else [(x.to(device), y.to(device)) for x, y in batches]
    step = train_step(model, opt)
    if replay:
        import djinn

        run = djinn.replayable(step)
    else:
        run = step
    CALLS.clear()
    t0 = time.perf_counter()
    for x, y in data:
        if inside:
            x, y = x.to(device), y.to(device)
        run(x, y)
        CALLS.append(time.perf_counter())
    params = [p.detach().cpu() for p in model.parameters()]  # waits for every step
    took = time.perf_counter() - t0
    if replay:
        REPLAYS.append({"optimizer": optimizer, **run.stats()})
    return took, params


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


@contextlib.contextmanager
def using(address: str) -> Iterator[None]:
    """The transparent frontend's default session on the appliance at ``address``."""
    from djinn.frontend import session

    os.environ["DJINN_ADDRESS"] = address
    session.reset()
    try:
        yield
    finally:
        session.reset()
        os.environ.pop("DJINN_ADDRESS", None)


def scheduler_stats(address: str, part: str) -> dict:
    """Worker 0's ``part`` of the appliance's stats (``graph_plans``, ``cuda_graphs``)."""
    import djinn

    with djinn.connect(address) as client:
        return client.stats()["scheduler"][0][part]


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
    batches = batches_of(args.width, args.steps, args.batch, args.seq)
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        for name in ("plans", "uncompiled", "interpreted", "spinning", "beside"):
            (work / name).mkdir()
        planned = stack.enter_context(appliance(work / "plans", GiB, "none"))
        uncompiled = stack.enter_context(
            appliance(work / "uncompiled", GiB, "none", graph_compile_after=0)
        )
        interpreted = stack.enter_context(
            appliance(work / "interpreted", GiB, "none", graph_plan_after=0)
        )
        spinning = stack.enter_context(
            appliance(work / "spinning", GiB, "none", cpu_wait_policy="inherit")
        )
        beside = stack.enter_context(
            appliance(work / "beside", GiB, "none", cpu_threads_beside_client=True)
        )
        for app in (planned, uncompiled, interpreted, spinning, beside):
            with using(app.unix):
                loop(model, batches[:2], R)  # warm: the appliance's kernels, the meta caches
        loop(model, batches[:2], "cpu")
        local_s, remote_s, interp_s, all_s, diffs, all_diffs = [], [], [], [], [], []
        spin_s, plan_s = [], []
        rows: dict[str, list[float]] = {}  # the replay rows' seconds
        replay_diffs: dict[str, float] = {}
        for app in (planned, uncompiled):
            with using(app.unix):
                for optimizer in REPLAYED:
                    loop(model, batches[:4], R, optimizer, replay=True)  # warm
        with using(planned.unix):
            loop(model, batches[:2], R, "foreach")  # warm
        for _ in range(args.repeat):
            took, want = loop(model, batches, "cpu")
            local_s.append(took)
            rows.setdefault("adam local", []).append(took)
            rows.setdefault("adam local steady", []).append(steady())
            with using(planned.unix):
                took, got = loop(model, batches, R)
            remote_s.append(took)
            diffs.append(max_diff(got, want))
            with using(uncompiled.unix):
                took, other = loop(model, batches, R)
            plan_s.append(took)
            if any(not torch.equal(a, b) for a, b in zip(got, other, strict=True)):
                raise AssertionError("a compiled plan's results differ from the plan's")
            with using(interpreted.unix):
                took, other = loop(model, batches, R)
            interp_s.append(took)
            if any(not torch.equal(a, b) for a, b in zip(got, other, strict=True)):
                raise AssertionError("a plan's results differ from the interpreted run's")
            with using(spinning.unix):
                took, other = loop(model, batches, R)
            spin_s.append(took)
            if any(not torch.equal(a, b) for a, b in zip(got, other, strict=True)):
                raise AssertionError("spinning threads changed the results")
            with using(beside.unix):
                took, other = loop(model, batches, R)
            all_s.append(took)
            all_diffs.append(max_diff(other, want))
            took, foreach_want = loop(model, batches, "cpu", "foreach")
            rows.setdefault("foreach local", []).append(took)
            with using(planned.unix):
                took, other = loop(model, batches, R, "foreach")
            rows.setdefault("foreach", []).append(took)
            foreach_diff = max_diff(other, foreach_want)
            replay_diffs["foreach"] = max(replay_diffs.get("foreach", 0.0), foreach_diff)
            with using(planned.unix):
                took, other = loop(model, batches, R, "adam", replay=True)
                rows.setdefault("adam", []).append(took)
                rows.setdefault("adam steady", []).append(steady())
                replay_diffs["adam"] = max(replay_diffs.get("adam", 0.0), max_diff(other, want))
                took, captured = loop(model, batches, R, "capturable")
                rows.setdefault("capturable captured", []).append(took)
                took, other = loop(model, batches, R, "capturable", replay=True)
                rows.setdefault("capturable", []).append(took)
                replay_diffs["capturable"] = max(
                    replay_diffs.get("capturable", 0.0), max_diff(other, captured)
                )
                replay_diffs["capturable vs adam"] = max_diff(other, want)
            took, sgd_want = loop(model, batches, "cpu", "sgd")
            rows.setdefault("sgd local", []).append(took)
            rows.setdefault("sgd local steady", []).append(steady())
            with using(planned.unix):
                took, other = loop(model, batches, R, "sgd")
                rows.setdefault("sgd captured", []).append(took)
                took, replayed = loop(model, batches, R, "sgd", replay=True)
                rows.setdefault("sgd", []).append(took)
                rows.setdefault("sgd steady", []).append(steady())
            with using(uncompiled.unix):
                took, other = loop(model, batches, R, "sgd", replay=True)
                rows.setdefault("sgd uncompiled", []).append(took)
            if any(not torch.equal(a, b) for a, b in zip(replayed, other, strict=True)):
                raise AssertionError("a compiled plan's results differ from the plan's")
            replay_diffs["sgd captured"] = max_diff(other, sgd_want)
            replay_diffs["sgd"] = max(replay_diffs.get("sgd", 0.0), max_diff(replayed, sgd_want))
            # each batch moved in by the loop itself (Note [puts sent without waiting])
            for optimizer, want_of in (("sgd", sgd_want), ("adam", want)):
                with using(planned.unix):
                    took, other = loop(model, batches, R, optimizer, replay=True, inside=True)
                rows.setdefault(f"{optimizer} inside", []).append(took)
                rows.setdefault(f"{optimizer} inside steady", []).append(steady())
                diff = max(replay_diffs.get(f"{optimizer} inside", 0.0), max_diff(other, want_of))
                replay_diffs[f"{optimizer} inside"] = diff
        plans = scheduler_stats(planned.unix, "graph_plans")
    local, remote = statistics.median(local_s), statistics.median(remote_s)
    interp, every = statistics.median(interp_s), statistics.median(all_s)
    spin, plan = statistics.median(spin_s), statistics.median(plan_s)
    med = {k: statistics.median(v) for k, v in rows.items()}
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)
    _, other = loop(model, batches, "cpu")
    torch.set_num_threads(threads)
    floor = max_diff(other, want)
    print(md_table(
        ["loop", "local eager s", "remote s", "remote / local", "max |param diff|",
         "local vs local, other thread count"],
        [[f"{args.steps} Adam steps, TransformerEncoder {args.layers}x{args.width}",
          f"{local:.3f}", f"{remote:.3f}", f"{remote / local:.2f}x", f"{max(diffs):.1e}",
          f"{floor:.1e}"],
         ["same, plans not compiled (graph_compile_after = 0)", f"{local:.3f}",
          f"{plan:.3f}", f"{plan / local:.2f}x", "bit-identical to the first row", ""],
         ["same, the worker interpreting every step (graph_plan_after = 0)", f"{local:.3f}",
          f"{interp:.3f}", f"{interp / local:.2f}x", "bit-identical to the first row", ""],
         ["same, idle OpenMP threads spinning as the runtime's default (cpu_wait_policy ="
          " inherit)", f"{local:.3f}", f"{spin:.3f}", f"{spin / local:.2f}x",
          "bit-identical to the first row", ""],
         ["same, a graph sent without waiting on a thread fewer (cpu_threads_beside_client"
          " = true)", f"{local:.3f}", f"{every:.3f}", f"{every / local:.2f}x",
          f"{max(all_diffs):.1e}", ""],
         ["Adam(foreach=True), vs local eager Adam(foreach=True)",
          f"{med['foreach local']:.3f}", f"{med['foreach']:.3f}",
          f"{med['foreach'] / med['foreach local']:.2f}x", f"{replay_diffs['foreach']:.1e}",
          ""]],
    ))  # fmt: skip
    last = {r["optimizer"]: r for r in REPLAYS}
    print()
    print(md_table(
        ["replayed step (djinn.replayable)", "reference s", "remote s", "remote / reference",
         f"per step from call {STEADY_FROM + 1}: remote / reference",
         "max |param diff| vs reference", "replays of the last loop"],
        [["default Adam (its step runs at each call, followed: "
          f"{last['adam']['steps_followed']}), vs local eager Adam", f"local {local:.3f}",
          f"{med['adam']:.3f}", f"{med['adam'] / local:.2f}x (captured: {remote / local:.2f}x)",
          f"{med['adam steady'] * 1e3:.2f} / {med['adam local steady'] * 1e3:.2f} ms = "
          f"{med['adam steady'] / med['adam local steady']:.2f}x",
          f"{replay_diffs['adam']:.1e}", f"{last['adam']['replays']}"],
         ["Adam(capturable=True), vs the same loop captured op by op",
          f"captured {med['capturable captured']:.3f}", f"{med['capturable']:.3f}",
          f"{med['capturable'] / med['capturable captured']:.2f}x (local: "
          f"{med['capturable'] / local:.2f}x)", "", f"{replay_diffs['capturable']:.1e} "
          f"(vs local default Adam: {replay_diffs['capturable vs adam']:.1e})",
          f"{last['capturable']['replays']}"],
         ["SGD (momentum 0.9), vs local eager SGD", f"local {med['sgd local']:.3f}",
          f"{med['sgd']:.3f}", f"{med['sgd'] / med['sgd local']:.2f}x (captured: "
          f"{med['sgd captured'] / med['sgd local']:.2f}x; plans not compiled: "
          f"{med['sgd uncompiled'] / med['sgd local']:.2f}x)",
          f"{med['sgd steady'] * 1e3:.2f} / {med['sgd local steady'] * 1e3:.2f} ms = "
          f"{med['sgd steady'] / med['sgd local steady']:.2f}x",
          f"{replay_diffs['sgd']:.1e} (captured: {replay_diffs['sgd captured']:.1e})",
          f"{last['sgd']['replays']}"]] + [
         [f"{name}, each batch moved in by the loop (`x.to(remote)` each step)",
          f"local {med[local_key]:.3f}", f"{med[key + ' inside']:.3f}",
          f"{med[key + ' inside'] / med[local_key]:.2f}x",
          f"{med[key + ' inside steady'] * 1e3:.2f} / {med[local_key + ' steady'] * 1e3:.2f} ms"
          f" = {med[key + ' inside steady'] / med[local_key + ' steady']:.2f}x",
          f"{replay_diffs[key + ' inside']:.1e}", f"{last[key]['replays']}"]
         for name, key, local_key in (("SGD", "sgd", "sgd local"),
                                      ("default Adam", "adam", "adam local"))],
    ))  # fmt: skip
    print(f"\nplans: {plans['runs']} requests run by {plans['plans']} plans "
          f"({plans['nodes']} nodes), {plans['compiled_runs']} of them compiled "
          f"({plans['compiled']} compiled, {plans['uncompiled']} left uncompiled); refused "
          f"templates: {plans['refused']}")  # fmt: skip
    print(f"\n(batch {args.batch} x {args.seq} tokens; medians of {args.repeat}; goal <= 1.20x)")
    save_json({"local_s": local_s, "remote_s": remote_s, "interpreted_s": interp_s,
               "spinning_s": spin_s, "beside_client_s": all_s, "uncompiled_s": plan_s,
               "beside_client_max_param_diff": max(all_diffs),
               "plans": plans, "max_param_diff": max(diffs),
               "local_threads_diff": floor,
               "replay_s": rows, "replay_max_param_diff": replay_diffs,
               "replay_stats": REPLAYS[-len(REPLAYED):],
               "args": vars(args), "torch": torch.__version__}, args.json)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
