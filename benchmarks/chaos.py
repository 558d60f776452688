"""Chaos: a decode loop and a training loop while a killer SIGKILLs their worker.

One private appliance (``cpu_workers`` CPU workers, default 2). The program uses the
transparent frontend's default session, which recovers (Note [lineage journal]):

- decode: GPT-2 small (built from ``GPT2Config``, random weights, seed 0) registered on
  the model path; greedy sequences of ``--new-tokens`` tokens, each from its own seeded
  prompt, with the KV cache kept on the appliance;
- training: an MLP on ``remote_accelerator`` (graph path) with Adam, each step's batch
  from its own seed, random dropout masks drawn on the appliance.

A killer thread SIGKILLs the worker serving the session every ``--interval`` seconds,
half of ``--kills`` during each loop, waiting before each kill until the previous
recovery is done, a replacement worker is ready and, with ``--standby`` (the default),
the session's warm standby (Note [warm standby]) holds GPT-2 on the other worker; a loop
runs until its kills are done and then to the end of its sequence or step. The same work
then runs again without faults and the results are compared: every token, every
parameter (max abs difference). Reported per kill:
recovery time (from the fault the client met to a rebuilt session, re-registration of
GPT-2 small and replay included) and kill-to-recovered time, as p50/p99. Afterwards,
with the session closed and the appliance stopped: /dev/shm bytes left, the client's
open fds against before, the supervisor's fds against before the first kill, and the
VMU's data/stack bytes with no session open.

Each CPU worker runs torch with ``--cpu-threads`` threads (``cpu_threads``; default
its share of the cores, cores / workers: two workers of two threads each on two cores
keep OpenMP threads waiting on each other, a GPT-2 prefill 7x slower on a loaded host;
0: torch's default). The load average (``os.getloadavg``) is reported at the start and
the end: the machine may be shared.

    python benchmarks/chaos.py [--kills 20] [--interval 4] [--workers 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from _appliance import appliance, unwind_on_sigterm
from _common import MiB, note, save_json
from _report import md_table

R = "remote_accelerator:0"


def shm_bytes(pid: int) -> int:
    """Bytes of the shared-memory segments the appliance ``pid`` made (their names carry
    its pid; other appliances on the machine are not ours to count)."""
    total = 0
    for p in Path("/dev/shm").glob(f"djinn-*-{pid}-*"):
        with contextlib.suppress(OSError):
            total += p.stat().st_blocks * 512
    return total


def fds(pid: int | str = "self") -> dict[str, str]:
    out = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            out[fd] = os.readlink(f"/proc/{pid}/fd/{fd}")
    return out


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class Killer:
    """SIGKILLs the worker serving the default session, ``count`` times, ``interval`` s
    apart, each time once the previous recovery is done, every worker is ready and (with
    ``--standby``) the standby is warm on the other worker."""

    def __init__(self, stats: Any, session: Any, interval: float, deadline: float) -> None:
        self.stats, self.session, self.interval = stats, session, interval
        self.deadline = deadline
        self.standby = False
        self.killed_at: list[float] = []
        self.count = 0
        self.done = threading.Event()
        self.stop = threading.Event()

    def start(self, count: int) -> None:
        self.count = count
        self.done.clear()
        threading.Thread(target=self._run, name="chaos-killer", daemon=True).start()

    def _ready(self) -> bool:
        workers = self.stats()["workers"]
        rec = self.session.recovery_stats()
        if self.standby and rec["standby_worker"] in (None, self.session.worker):
            return False  # the standby is still being made on the replacement
        ready = all(w["alive"] and w["ready"] for w in workers)
        return ready and len(rec["recovery_s"]) >= len(self.killed_at)

    def _run(self) -> None:
        for _ in range(self.count):
            if self.stop.wait(self.interval):
                break
            while not self._ready():
                if self.stop.wait(0.05) or time.monotonic() > self.deadline:
                    self.done.set()
                    return
            pid = next(w["pid"] for w in self.stats()["workers"] if w["id"] == self.session.worker)
            os.kill(pid, signal.SIGKILL)
            self.killed_at.append(time.monotonic())
            note(f"kill {len(self.killed_at)}: worker pid {pid}")
        self.done.set()


def decode(model: Any, sequences: int | None, new_tokens: int, until: threading.Event) -> list:
    """Greedy sequences; ``sequences`` of them, or until ``until`` is set (then one more)."""
    out: list[list[int]] = []
    i = 0
    while (sequences is None and not until.is_set()) or (sequences is not None and i < sequences):
        g = torch.Generator().manual_seed(1000 + i)
        ids = torch.randint(0, 50000, (1, 8), generator=g)
        step = model(ids, use_cache=True)
        tokens = []
        for _ in range(new_tokens):
            nxt = step.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(int(nxt.item()))
            step = model(nxt, past_key_values=step.past_key_values, use_cache=True)
        out.append(tokens)
        del step
        i += 1
    return out


def train(steps: int | None, until: threading.Event) -> tuple[int, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.1),  # random ops on the appliance: replayed with their state
        torch.nn.Linear(256, 10),
    ).to(R)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    i = 0
    while (steps is None and not until.is_set()) or (steps is not None and i < steps):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(32, 64, generator=g).to(R)
        y = torch.randint(0, 10, (32,), generator=g).to(R)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if i % 10 == 9:
            loss.item()  # the program reads its loss now and then
        i += 1
    return i, [p.detach().cpu() for p in model.parameters()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--interval", type=float, default=4.0, help="seconds between kills")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--time-limit", type=float, default=1500.0)
    parser.add_argument(
        "--standby",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="recovery_standby: keep GPT-2 on a second worker too (Note [warm standby])",
    )
    parser.add_argument(
        "--cpu-threads",
        type=int,
        default=None,
        help="cpu_threads of each worker (default: cores / workers; 0: torch's default)",
    )
    parser.add_argument("--json", default="benchmarks/results/chaos.json")
    args = parser.parse_args()
    unwind_on_sigterm()
    import transformers

    started = time.monotonic()
    load_before = os.getloadavg()
    threads = args.cpu_threads
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // args.workers)
    arena = (1536 * MiB) * args.workers
    with tempfile.TemporaryDirectory() as tmp:
        extra = {
            "cpu_workers": args.workers,
            "cpu_threads": threads,
            "restart_backoff_max": 2.0,
            "log_level": "error",
        }
        with appliance(Path(tmp), arena, "none", **extra) as app:
            os.environ["DJINN_ADDRESS"] = app.unix
            os.environ["DJINN_RECOVERY_STANDBY"] = "true" if args.standby else "false"
            os.environ["DJINN_RECOVERY_RETRIES"] = "5"
            import djinn  # noqa: F401 - the remote_accelerator device
            from djinn.frontend import session as frontend
            from djinn.runtime.client import Client

            admin = Client(app.unix)
            sup_pid = admin.stats()["appliance"]["pid"]
            fds_before = fds()
            session = frontend.default_session()
            sup_fds_before = fds(sup_pid)
            killer = Killer(admin.stats, session, args.interval, started + args.time_limit)
            killer.standby = args.standby
            torch.manual_seed(0)
            cfg = transformers.GPT2Config(n_layer=args.layers)
            note(f"registering GPT-2 ({args.layers} layers)")
            model = transformers.GPT2LMHeadModel(cfg).eval().to(R)

            half = args.kills // 2
            note(f"decode under {half} kills")
            killer.start(half)
            got_tokens = decode(model, None, args.new_tokens, killer.done)
            decode_kills = len(killer.killed_at)
            note(f"training under {args.kills - half} kills")
            killer.start(args.kills - half)
            got_steps, got_params = train(None, killer.done)
            killer.stop.set()
            stats = session.recovery_stats()
            note("the same work without faults")
            ref_tokens = decode(model, len(got_tokens), args.new_tokens, threading.Event())
            _, ref_params = train(got_steps, threading.Event())
            journal = session.recovery_stats()
            frontend.reset()  # closes the session: everything it held is freed
            time.sleep(0.5)
            after = admin.stats()
            sup_fds_after = fds(sup_pid)
            admin.close()
            fds_after = fds()
    time.sleep(0.2)
    shm_after = shm_bytes(sup_pid)
    fd_leaks = sorted(set(fds_after.values()) - set(fds_before.values()))
    sup_fd_leaks = sorted(set(sup_fds_after.values()) - set(sup_fds_before.values()))

    kills = len(killer.killed_at)
    recovered = stats["recoveries"]
    recovery = stats["recovery_s"]
    to_recovered = [
        r - k for k, r in zip(killer.killed_at, stats["recovered_at"], strict=False) if r >= k
    ]
    tokens_equal = got_tokens == ref_tokens
    diff = max((a - b).abs().max().item() for a, b in zip(got_params, ref_params, strict=True))
    vmu = after["vmu"]["devices"]
    data_left = sum(d["data"]["used"] + d["stack"]["used"] for d in vmu)
    load_after = os.getloadavg()
    by_loop = {"decode": recovery[:decode_kills], "training": recovery[decode_kills:]}
    arena_left = after["vmu"]["host_arena"]["used"]
    doc = {
        "kills": kills,
        "decode_kills": decode_kills,
        "recoveries": recovered,
        "workers": args.workers,
        "standby": args.standby,
        "standby_s": stats.get("standby_s", []),
        "decode": {
            "sequences": len(got_tokens),
            "tokens": sum(map(len, got_tokens)),
            "equal": tokens_equal,
        },
        "training": {"steps": got_steps, "max_abs_diff": diff},
        "recovery_s": {
            "p50": pct(recovery, 0.5),
            "p99": pct(recovery, 0.99),
            "all": recovery,
        },
        "recovery_s_by_loop": {
            k: {"p50": pct(v, 0.5), "max": max(v, default=float("nan"))} for k, v in by_loop.items()
        },
        "replay_s": {"p50": pct(stats["replay_s"], 0.5), "p99": pct(stats["replay_s"], 0.99)},
        "kill_to_recovered_s": {"p50": pct(to_recovered, 0.5), "p99": pct(to_recovered, 0.99)},
        "replayed_requests": stats["replayed"],
        "replay_kinds": stats["replay_kinds"],
        "journal": {k: v for k, v in journal.items() if k.startswith(("journal", "checkpoint"))},
        "leaks": {
            "shm_bytes": shm_after,
            "client_fds": len(fds_after) - len(fds_before),
            "client_fds_new": fd_leaks,
            "supervisor_fds": len(sup_fds_after) - len(sup_fds_before),
            "supervisor_fds_new": sup_fd_leaks,
            "vmu_data_stack_bytes": data_left,
            "host_arena_bytes": arena_left,
        },
        "elapsed_s": round(time.monotonic() - started, 1),
        "cpu_threads": threads,
        "loadavg": {"start": list(load_before), "end": list(load_after)},
        "torch": torch.__version__,
    }
    mode = "warm standby" if args.standby else "no standby"
    print(
        f"\n# Chaos: {kills} SIGKILLs of the session's worker "
        f"({args.workers} CPU workers of {threads or 'default'} threads, {mode})\n"
    )
    rows = [
        ["recoveries", f"{recovered}/{kills}", "20/20"],
        [
            "decode: tokens equal to fault-free",
            f"{tokens_equal} ({doc['decode']['tokens']} tokens, {len(got_tokens)} sequences)",
            "True",
        ],
        ["training: max abs param diff", f"{diff:.1e} ({got_steps} Adam steps)", "<= 1e-6"],
        [
            "recovery p50 / p99 (s)",
            f"{pct(recovery, 0.5):.2f} / {pct(recovery, 0.99):.2f}",
            "p99 <= 2 s",
        ],
        *[
            [f"  {k} recoveries p50 / max (s)", f"{pct(v, 0.5):.2f} / {max(v):.2f}", ""]
            for k, v in by_loop.items()
            if v
        ],
        [
            "  of which replay p50 / p99 (s)",
            f"{doc['replay_s']['p50']:.2f} / {doc['replay_s']['p99']:.2f}",
            "",
        ],
        [
            "kill to recovered p50 / p99 (s)",
            f"{pct(to_recovered, 0.5):.2f} / {pct(to_recovered, 0.99):.2f}",
            "",
        ],
        ["/dev/shm bytes left by the appliance", str(shm_after), "0"],
        [
            "client fds, after vs before the session",
            str(len(fds_after) - len(fds_before)),
            "0",
        ],
        [
            "supervisor fds, after vs before the kills",
            str(len(sup_fds_after) - len(sup_fds_before)),
            "0",
        ],
        ["VMU data+stack bytes, no session", str(data_left), "0"],
        ["host arena bytes, no session", str(arena_left), "0"],
        [
            "load average 1/5/15 min, start / end",
            " / ".join(" ".join(f"{x:.2f}" for x in la) for la in (load_before, load_after)),
            "",
        ],
    ]
    print(md_table(["measure", "result", "goal"], rows))
    print(f"\n{doc['elapsed_s']} s; JSON: {args.json}")
    save_json(doc, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
