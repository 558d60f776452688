"""Isolation: a victim session's correctness and latency while a neighbour misbehaves.

    python benchmarks/isolation.py [--iters 300] [--json PATH]

One appliance with one CPU worker, so victim and neighbour share the worker, its arena
and its single serving thread (the hard case). The victim loops: PUT a 256 KiB tensor,
run an op on it, fetch the result, compare every byte with what it must be. It runs
alone first, then beside three neighbours, each in its own process (issue 17):

- ``flood``: a TCP session uploading 4 MiB tensors as fast as it can;
- ``crash``: a session sending the EXEC nodes that used to crash the worker
  (``to.prim_dtype(t, None, True, True)``, an unsupported dtype enum...);
- ``hog``: a session leasing arena slabs until refused, then holding them.

Goals: 0 corrupted bytes, 0 victim errors, victim p99 <= 2x its p99 alone (same run).
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _appliance import appliance, connect, unwind_on_sigterm
from _common import MiB, note, save_json
from _report import md_table

VICTIM_ELEMS = 64 << 10  # float32: 256 KiB
NEIGHBOURS = ("flood", "crash", "hog")
CRASHERS = [
    {"op": "aten::to.prim_dtype", "args": ["H", None, True, True]},
    {"op": "aten::to.dtype", "args": ["H", 2147483647]},
    {"op": "aten::_fft_c2r.default", "args": ["C", [1], 7, 6]},
    {"op": "aten::zeros.default", "args": [[1 << 16, 1 << 16]]},
]


def victim(app: Any, iters: int) -> dict[str, Any]:
    """Latencies (s) of put -> op -> fetch round trips, errors and corrupted bytes."""
    lat: list[float] = []
    errors, corrupted = 0, 0
    gen = torch.Generator().manual_seed(0)
    with connect(app, "unix") as client, client.session() as s:
        for _ in range(iters):
            x = torch.rand(VICTIM_ELEMS, generator=gen)
            t0 = time.perf_counter()
            try:
                h = s.put(x)
                node = {"op": "aten::mul.Tensor", "args": [{"$h": h.handle}, 3.0]}
                _, (y,) = s.execute([node], fetch=[{"$v": 0}])
                back = h.cpu()
            except Exception as exc:  # counted: the victim must never see one
                errors += 1
                print(f"victim error: {exc}", file=sys.stderr)
                continue
            lat.append(time.perf_counter() - t0)
            if len(lat) % 50 == 0:
                note(f"victim: {len(lat)} round trips")
            corrupted += int((back.view(torch.uint8) != x.view(torch.uint8)).sum())
            want = (x * 3.0).view(torch.uint8)
            corrupted += int((y.view(torch.uint8) != want).sum())
    lat.sort()
    return {
        "iters": iters,
        "ok": len(lat),
        "errors": errors,
        "corrupted_bytes": corrupted,
        "p50_ms": 1e3 * statistics.median(lat) if lat else float("nan"),
        "p99_ms": 1e3 * lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else float("nan"),
    }


def neighbour(kind: str, unix: str, tcp: str, token: str, stop: Any, counts: Any) -> None:
    """One misbehaving session, in its own process, until ``stop`` is set."""
    from djinn.errors import DjinnError
    from djinn.protocol.frames import Kind
    from djinn.runtime.client import Client

    client = Client(tcp, token) if kind == "flood" else Client(unix)
    with client, client.session() as s:
        held = []
        big = torch.ones(MiB)  # 4 MiB of float32
        c = s.put(torch.randn(4, 4, dtype=torch.complex64))
        h = s.put(torch.ones(3))
        while not stop.is_set():
            try:
                if kind == "flood":
                    held = [s.put(big)]
                elif kind == "crash":
                    for node in CRASHERS:
                        args = [
                            {"$h": h.handle} if a == "H" else {"$h": c.handle} if a == "C" else a
                            for a in node["args"]
                        ]
                        try:
                            s.execute([{"op": node["op"], "args": args}], fetch=[{"$v": 0}])
                        except DjinnError:
                            counts[kind] += 1  # refused, as it must be
                else:
                    try:
                        held.append(s._call(Kind.ALLOC, {"sizes": [MiB]}))
                    except DjinnError:
                        counts[kind] += 1
                        time.sleep(0.01)  # full: hold what we have, ask again
                    continue
                counts[kind] += 1
            except DjinnError as exc:
                print(f"neighbour {kind}: {exc}", file=sys.stderr)
                time.sleep(0.05)


def burn(stop: Any) -> None:
    """A process that competes for the CPU and never talks to the appliance."""
    while not stop.is_set():
        sum(range(10_000))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--json", default="benchmarks/results/isolation.json")
    parser.add_argument("--neighbours", default=",".join(NEIGHBOURS))
    args = parser.parse_args()
    unwind_on_sigterm()
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp, appliance(Path(tmp), 256 * MiB, "none") as app:
        alone = victim(app, args.iters)
        # the machine's share: as many processes that only burn CPU, no appliance traffic
        stop = ctx.Event()
        burners = [ctx.Process(target=burn, args=(stop,)) for _ in args.neighbours.split(",")]
        for p in burners:
            p.start()
        time.sleep(1.0)
        beside_cpu = victim(app, args.iters)
        stop.set()
        for p in burners:
            p.join(30)
        stop, manager = ctx.Event(), ctx.Manager()
        counts = manager.dict({k: 0 for k in NEIGHBOURS})
        procs = [
            ctx.Process(target=neighbour, args=(k, app.unix, app.tcp, app.token, stop, counts))
            for k in args.neighbours.split(",")
        ]
        for p in procs:
            p.start()
        note("neighbours started")
        time.sleep(3.0)  # let them connect and get going (the hog fills its share)
        beside = victim(app, args.iters)
        stop.set()
        for p in procs:
            p.join(30)
        neighbour_ops = dict(counts)
        manager.shutdown()
    ratio = beside["p99_ms"] / alone["p99_ms"]
    doc = {
        "victim_alone": alone,
        "victim_beside_cpu_burners": beside_cpu,
        "victim_beside_neighbours": beside,
        "p99_ratio": ratio,
        "p99_ratio_cpu_burners": beside_cpu["p99_ms"] / alone["p99_ms"],
        "neighbour_requests": neighbour_ops,
        "goals": {
            "corrupted_bytes_0": alone["corrupted_bytes"] + beside["corrupted_bytes"] == 0,
            "victim_errors_0": alone["errors"] + beside["errors"] == 0,
            "p99_within_2x": ratio <= 2.0,
        },
        "torch": torch.__version__,
    }
    rows = [
        [name, str(r["ok"]), str(r["errors"]), str(r["corrupted_bytes"]), f"{r['p50_ms']:.2f}",
         f"{r['p99_ms']:.2f}"]
        for name, r in (("victim alone", alone),
                        ("victim + as many CPU burners (no appliance traffic)", beside_cpu),
                        ("victim + flood/crash/hog", beside))
    ]  # fmt: skip
    print(md_table(["run", "ok", "errors", "corrupted bytes", "p50 ms", "p99 ms"], rows))
    print(
        f"\nvictim p99 beside neighbours / alone: {ratio:.2f}x (goal <= 2x); beside as "
        f"many CPU burners: {doc['p99_ratio_cpu_burners']:.2f}x (the machine's share)"
    )
    print(f"neighbour requests served or refused: {neighbour_ops}")
    print(json_line(doc))
    save_json(doc, args.json)
    return 0 if all(doc["goals"].values()) else 1


def json_line(doc: dict[str, Any]) -> str:
    import json

    return json.dumps(doc)


if __name__ == "__main__":
    sys.exit(main())
