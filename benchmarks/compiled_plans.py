"""A worker's three ways to run a repeated graph, in one process, against local eager
(issue 11 §2, Note [compiled plans]).

A repeated call is recorded once through ``djinn.replayable`` on a private appliance; its
graph template and its input tensors are then read back, and the call's graph is run
here, in this process, as a worker runs it:

- interpreted: every op decoded and checked (``GraphRun``, Note [op validation]);
- planned: by its execution plan, op by op (``PlanRun``, Note [graph plans]);
- compiled: by the plan's generated function (``CompiledRun``, Note [compiled plans]);

beside the same call in local eager PyTorch, all in the same rounds. No socket and no
other process is involved: the figures are the worker's execution alone, so they say what
the worker adds to the kernels. Each round runs each way ``--calls`` times; the table
gives the median round's milliseconds per call and its ratio to local eager, and the
script checks that the three ways give the same bits (exit status 1 if not).

Workloads (``--workload``):

- ``sgd`` (default): the SGD step of ``training_step.py``, a ``TransformerEncoder`` of
  ``--layers`` x ``--width``, MSE loss, SGD with momentum;
- ``gpt2``: the forward of a randomly initialised GPT-2 of ``--layers`` layers (12 for
  GPT-2 small) on ``--seq`` tokens, under ``torch.no_grad()``, the call ``capture.py``
  replays.

``--inductor`` adds the local call under ``torch.compile`` (inductor, on the CPU: the
forward with its backward, and the optimizer step), compiled by its first two calls
(timed apart) and then timed in the same rounds: whether a compiler on the worker could
run the graph faster than eager does (issue 11 §2, "whichever measures best").

    python benchmarks/compiled_plans.py                       # about 40 s
    python benchmarks/compiled_plans.py --inductor            # and torch.compile, ~70 s
    python benchmarks/compiled_plans.py --workload gpt2 --layers 12 --seq 64 --calls 3
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _appliance import appliance
from _common import GiB, save_json
from _report import md_table
from training_step import build, train_step, using

R = "remote_accelerator:0"


def sgd_step(args: argparse.Namespace) -> tuple[Callable, tuple, Callable, str, Callable]:
    """(the remote call, its remote arguments, the same call in local eager, a title, a
    maker of the same local call under ``torch.compile``)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.seq, args.width, generator=gen)
    y = torch.randn(args.batch, args.seq, 1, generator=gen)
    model = build(args.width, args.layers).train()
    local = copy.deepcopy(model)
    remote = model.to(R)
    opt = torch.optim.SGD(remote.parameters(), lr=1e-2, momentum=0.9)
    local_opt = torch.optim.SGD(local.parameters(), lr=1e-2, momentum=0.9)
    step = train_step(remote, opt)

    def eager() -> None:
        local_opt.zero_grad()
        torch.nn.functional.mse_loss(local(x), y).backward()
        local_opt.step()

    def inductor() -> Callable[[], None]:
        """The same local step with its forward (and so its backward) and its optimizer
        step under ``torch.compile``: the best a compiler on this CPU could give."""
        own = copy.deepcopy(local)
        own_opt = torch.optim.SGD(own.parameters(), lr=1e-2, momentum=0.9)
        loss = torch.compile(lambda: torch.nn.functional.mse_loss(own(x), y))
        update = torch.compile(own_opt.step)

        def compiled() -> None:
            own_opt.zero_grad()
            loss().backward()
            update()

        return compiled

    title = (f"SGD training step, TransformerEncoder {args.layers}x{args.width}, batch "
             f"{args.batch}x{args.seq}")  # fmt: skip
    return step, (x.to(R), y.to(R)), eager, title, inductor


def gpt2_forward(args: argparse.Namespace) -> tuple[Callable, tuple, Callable, str, Callable]:
    import transformers

    cfg = transformers.GPT2Config(n_layer=args.layers)
    torch.manual_seed(0)
    local = transformers.GPT2LMHeadModel(cfg).eval()
    # moved in training mode so it stays on the graph path (capture.py says why)
    remote = copy.deepcopy(local).train().to(R).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, args.seq))

    def forward(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return remote(x).logits

    def eager() -> None:
        with torch.no_grad():
            local(ids)

    def inductor() -> Callable[[], None]:
        own = torch.compile(copy.deepcopy(local))

        def compiled() -> None:
            with torch.no_grad():
                own(ids)

        return compiled

    title = f"GPT-2 forward, {args.layers} layers, {args.seq} tokens"
    return forward, (ids.to(R),), eager, title, inductor


WORKLOADS = {"sgd": sgd_step, "gpt2": gpt2_forward}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="sgd")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default="benchmarks/results/compiled_plans.json")
    parser.add_argument(
        "--inductor",
        action="store_true",
        help="also time the local call under torch.compile (inductor, CPU: 10-30 s to compile)",
    )
    args = parser.parse_args()
    import djinn
    from djinn.frontend.session import default_session
    from djinn.protocol.frames import Kind

    with (
        tempfile.TemporaryDirectory() as work,
        appliance(Path(work), GiB, "none") as app,
        using(app.unix),
    ):
        fn, remote_args, eager, title, inductor = WORKLOADS[args.workload](args)
        call = djinn.replayable(fn)
        for _ in range(3):
            call(*remote_args).cpu()
        rec = next(r for r in call._records.values() if hasattr(r, "tpl"))
        s = default_session()
        got = s._unpack(s._call(Kind.GET, {"handles": list(rec.handles)}))["tensors"]
        inline = [t.clone() for t in rec.inline]
    tensors = {h: t.clone() for h, t in zip(rec.handles, got, strict=True)}
    return compare(args, rec, tensors, inline, eager, title, inductor if args.inductor else None)


def compare(
    args: argparse.Namespace,
    rec: Any,
    tensors: dict[str, torch.Tensor],
    inline: list[torch.Tensor],
    eager: Callable[[], None],
    title: str,
    inductor: Callable[[], Callable[[], None]] | None = None,
) -> int:
    from djinn.appliance.executor.graph import GraphRun
    from djinn.appliance.executor.plan import CompiledRun, GraphPlans, PlanRun, input_signature
    from djinn.appliance.vmu.device import DeviceVMU
    from djinn.protocol import templates

    cpu, handles = torch.device("cpu"), list(rec.handles)
    stack = DeviceVMU(16 * GiB)["stack"]
    ins = [tensors[h] for h in handles]
    segments = [memoryview(t.numpy()) for t in inline]
    fp, body = rec.fingerprint, {"graph": rec.fingerprint, "inputs": handles,
                                 "scalars": rec.scalars}  # fmt: skip

    def interpreted_run() -> GraphRun:
        whole = templates.instantiate(rec.tpl, handles, rec.scalars)
        run = GraphRun(whole, tensors.__getitem__, segments, cpu, stack)
        run.template = fp
        return run

    def interpreted() -> tuple:
        return interpreted_run().run()

    recording = interpreted_run()
    recording.recording = []
    recording.run()
    plans = GraphPlans(after=1, compile_after=1)
    plan = plans.record(fp, rec.tpl, recording, input_signature(ins), rec.scalars, cpu)
    assert plan is not None, "the call's template was not planned"
    while plans.runner(plan, fp, cpu) is not CompiledRun:
        pass
    assert plan.code is not None, "the call's plan was not compiled"

    def by(runner: type) -> tuple:
        return runner(plan, fp, body, handles, ins, tensors.__getitem__, segments, cpu,
                      stack).run()  # fmt: skip

    # the same bits three ways: each runs the call once from the same inputs; compared:
    # what it kept and fetched, and what it wrote in place (a step's weights, momentum)
    start = {h: t.clone() for h, t in tensors.items()}
    outs = []
    for way in (interpreted, lambda: by(PlanRun), lambda: by(CompiledRun)):
        for h, t in start.items():
            tensors[h].copy_(t)
        keep, fetch = way()
        outs.append([t.clone() for t in [*keep, *fetch, *ins] if isinstance(t, torch.Tensor)])
    same = all(torch.equal(a, b) for o in outs[1:] for a, b in zip(outs[0], o, strict=True))

    ways = {
        "local eager": eager,
        "interpreted (GraphRun)": interpreted,
        "planned (PlanRun)": lambda: by(PlanRun),
        "compiled (CompiledRun)": lambda: by(CompiledRun),
    }
    compile_s = None
    if inductor is not None:  # compiled by its first calls: timed apart from the rounds
        compiled = inductor()
        t0 = time.perf_counter()
        compiled()
        compiled()
        compile_s = time.perf_counter() - t0
        ways["local torch.compile (inductor)"] = compiled
    times: dict[str, list[float]] = {name: [] for name in ways}
    for fn in ways.values():
        for _ in range(3):
            fn()  # warm: the first calls pay one-time costs (thread pools, kernel choices)
    for _ in range(args.rounds):
        for name, fn in ways.items():
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fn()
            times[name].append((time.perf_counter() - t0) / args.calls * 1e3)
    med = {name: statistics.median(v) for name, v in times.items()}
    base = med["local eager"]
    print(f"{title}: {len(plan.nodes)} ops, {len(handles)} inputs; intra-op threads "
          f"{torch.get_num_threads()}\n")  # fmt: skip
    print(md_table(
        ["way", "ms per call (median round)", "/ local eager", "rounds (ms)"],
        [[name, f"{m:.2f}", f"{m / base:.2f}x", ", ".join(f"{t:.2f}" for t in times[name])]
         for name, m in med.items()],
    ))  # fmt: skip
    print(f"\nthe three worker runs give the same bits: {same}; plans "
          f"{plans.stats()}")  # fmt: skip
    if compile_s is not None:
        print(f"torch.compile: {compile_s:.1f} s for its first two calls")
    save_json({"workload": title, "ms": times, "median_ms": med, "same_bits": same,
               "ops": len(plan.nodes), "inputs": len(handles), "args": vars(args),
               "inductor_compile_s": compile_s,
               "torch": torch.__version__}, args.json)  # fmt: skip
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
