"""Worker memory under session churn: does a worker give back what sessions used?

Rounds of ``--sessions`` concurrent sessions (half over Unix, half over TCP) each put
tensors from 64 B to 4 MiB, run an op on the appliance, read results back and close. After
every round the script waits until the worker reports no session data, then reads the
worker's ``/proc/<pid>/status``:

- ``RssAnon``: the worker's private memory (Python objects, the CPU allocator's heap). This
  is what must stay flat: a leak, or memory cached and never given back, grows it.
- ``RssShmem``: pages of the host arena this worker has touched. The arena is one
  shared-memory segment the supervisor owns and every worker maps; it is accounted by the
  VMU, its size is fixed by ``arena_bytes``, and the pages stay mapped by design. It grows
  until the arena's working set has been touched once and says nothing about leaks.

The first ``--warmup`` rounds are excluded (imports, op kernels, first use of the
allocator). Reported: RssAnon after warm-up and at the end, its growth per 1,000 sessions
by a least-squares fit over the measured rounds, and the VMU's data bytes after each round
(back to 0 when every session's memory was freed).

    python benchmarks/soak.py                      # 24 rounds x 32 sessions (~2 min)
    python benchmarks/soak.py --rounds 64 --sessions 64
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from _appliance import appliance, connect, unwind_on_sigterm
from _common import MiB, note, save_json
from _report import md_table

SIZES = (16, 4096, 256 * 1024, 1024 * 1024)  # float32 elements: 64 B .. 4 MiB


def proc_status(pid: int) -> dict[str, int]:
    """The worker's RSS split, in KiB."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(value.split()[0])
    return out


def one_session(app: Any, i: int, errors: list[str]) -> None:
    try:
        with connect(app, "unix" if i % 2 else "tcp") as client, client.session() as s:
            handles = [s.put(torch.randn(n)) for n in SIZES]
            node = {"op": "aten::mul.Tensor", "args": [{"$h": handles[2].handle}, 3.0]}
            s.execute([node], fetch=[{"$v": 0}])
            handles[3].cpu()
    except Exception as exc:  # counted and printed: a soak session must not fail
        errors.append(repr(exc))


def worker_data_bytes(app: Any) -> tuple[int, int]:
    """(worker pid, bytes the worker's sessions hold), from the stats document."""
    with connect(app, "unix") as client:
        doc = client.stats()
    worker = doc["workers"][0]
    sessions = [s for s in doc["sessions"] if s.get("worker") in (None, worker.get("id"))]
    return worker["pid"], sum(s.get("bytes", 0) for s in sessions)


def slope_per_1000(xs: list[int], ys: list[float]) -> float:
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return 1000 * sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=24)
    parser.add_argument("--sessions", type=int, default=32, help="concurrent, per round")
    parser.add_argument("--warmup", type=int, default=4, help="rounds left out of the fit")
    parser.add_argument("--json", default="benchmarks/results/soak.json")
    args = parser.parse_args()
    unwind_on_sigterm()
    rows: list[dict[str, Any]] = []
    errors: list[str] = []
    with tempfile.TemporaryDirectory() as tmp, appliance(Path(tmp), 512 * MiB, "none") as app:
        pid, _ = worker_data_bytes(app)
        start = proc_status(pid)
        for rnd in range(args.rounds):
            threads = [
                threading.Thread(target=one_session, args=(app, i, errors))
                for i in range(args.sessions)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            deadline = time.monotonic() + 10
            while (data := worker_data_bytes(app)[1]) and time.monotonic() < deadline:
                time.sleep(0.05)  # closes are asynchronous: wait until the worker freed them
            status = proc_status(pid)
            rows.append({"round": rnd, "sessions": (rnd + 1) * args.sessions, "data": data,
                         **status})  # fmt: skip
            if rnd % 4 == 3:
                note(f"round {rnd + 1}/{args.rounds}: RssAnon {status['RssAnon'] >> 10} MiB")
    measured = rows[args.warmup :] or rows
    growth = slope_per_1000(
        [r["sessions"] for r in measured], [r["RssAnon"] / 1024 for r in measured]
    )
    table = [
        [str(r["round"] + 1), str(r["sessions"]), f"{r['RssAnon'] / 1024:.0f}",
         f"{r['RssShmem'] / 1024:.0f}", f"{r['VmRSS'] / 1024:.0f}", str(r["data"])]
        for r in rows
    ]  # fmt: skip
    print(md_table(["round", "sessions so far", "RssAnon MiB", "RssShmem MiB", "VmRSS MiB",
                    "VMU data bytes"], table))  # fmt: skip
    first, last = measured[0], rows[-1]
    print(
        f"\nworker RssAnon: {start['RssAnon'] / 1024:.0f} MiB at start, "
        f"{first['RssAnon'] / 1024:.0f} MiB after {args.warmup} warm-up rounds, "
        f"{last['RssAnon'] / 1024:.0f} MiB after {last['sessions']} sessions; "
        f"fitted growth {growth:+.2f} MiB per 1000 sessions"
    )
    print(f"session errors: {len(errors)}" + (f" (first: {errors[0]})" if errors else ""))
    doc = {
        "rounds": rows,
        "start": start,
        "rss_anon_growth_mib_per_1000_sessions": growth,
        "errors": len(errors),
        "torch": torch.__version__,
    }
    save_json(doc, args.json)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
