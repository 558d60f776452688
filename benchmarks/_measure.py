"""What the transport benchmark times: tiny put+get round trips, interleaved bulk rounds of
every path beside its ceilings, the statistics they are reduced to, and the CPU time other
processes took from the machine meanwhile."""

from __future__ import annotations

import gc
import os
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from _common import MiB, clock, fmt_bytes, note, seconds_since

if TYPE_CHECKING:
    import torch
    from _peers import Peer

    from djinn.runtime.client import Client
    from djinn.runtime.session import Session

# Small copies are timed a few times per round: a copy that is stalled by another
# process (a descheduled intra-op thread costs a whole time slice) is no ceiling.
MEMCPY_TRIES = 5


# -- statistics ---------------------------------------------------------------------------------
def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted sequence."""
    rank = max(1, -(-len(sorted_values) * q // 100))
    return sorted_values[int(rank) - 1]


def latency(samples_ns: Sequence[int]) -> dict[str, float]:
    us = sorted(ns / 1e3 for ns in samples_ns)
    return {
        "p50_us": round(statistics.median(us), 2),
        "p99_us": round(percentile(us, 99), 2),
        "mean_us": round(statistics.fmean(us), 2),
        "min_us": round(us[0], 2),
        "n": len(us),
    }


def rate(nbytes: int, seconds: Sequence[float]) -> dict[str, float]:
    """GB/s (1e9 bytes per second): best of the repetitions, and their median."""
    return {
        "best_gbps": round(nbytes / min(seconds) / 1e9, 3),
        "median_gbps": round(nbytes / statistics.median(seconds) / 1e9, 3),
        "reps": len(seconds),
    }


def ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b else float("nan")


def cpu_seconds() -> tuple[float, float] | None:
    """(busy CPU seconds of the whole machine, CPU seconds of this process and its reaped
    children). Their difference over a run is what other processes took from it."""
    import resource

    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]
    except OSError:
        return None
    ticks = [int(f) for f in fields]
    busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # minus idle, iowait
    own = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        own += usage.ru_utime + usage.ru_stime
    return busy, own


# -- tiny round trips ---------------------------------------------------------------------------
def tiny_djinn(client: Client, iterations: int, warmup: int) -> dict[str, dict[str, float]]:
    import torch

    from djinn.protocol.frames import Kind

    t = torch.arange(4, dtype=torch.float32)
    with client.session() as s:
        for _ in range(warmup):
            s.put(t).cpu()
        if not torch.equal(s.put(t).cpu(), t):
            raise AssertionError("tiny round trip returned different values")
        put_ns: list[int] = []
        get_ns: list[int] = []
        gc.collect()
        for _ in range(iterations):
            t0 = clock()
            r = s.put(t)
            t1 = clock()
            r.cpu()
            t2 = clock()
            put_ns.append(t1 - t0)
            get_ns.append(t2 - t1)
            del r  # its free rides along with the next request, as in real use
        # the put the frontend's `x.to(remote)` makes: not waited for, its reply read by
        # the get (Note [puts sent without waiting])
        unwaited_ns: list[int] = []
        for _ in range(warmup):
            s.put(t, wait=False).cpu()
        for _ in range(iterations):
            t0 = clock()
            s.put(t, wait=False).cpu()
            unwaited_ns.append(clock() - t0)
        beat_ns: list[int] = []
        for _ in range(warmup):
            s._call(Kind.HEARTBEAT)
        for _ in range(iterations):
            t0 = clock()
            s._call(Kind.HEARTBEAT)
            beat_ns.append(clock() - t0)
        split = split_tiny(client, s, t, iterations)
    return {
        "roundtrip": latency([p + g for p, g in zip(put_ns, get_ns, strict=True)]),
        "put": latency(put_ns),
        "get": latency(get_ns),
        "unwaited": latency(unwaited_ns),
        "heartbeat": latency(beat_ns),
        "split": split,
    }


def split_tiny(client: Client, s: Session, t: torch.Tensor, iterations: int) -> dict[str, Any]:
    """Where a tiny request's time goes: put, get and HEARTBEAT in turn, the client's time
    for each beside the worker's own for the same requests (``worker_time``). A loop of
    its own, run after the timed ones: reading the stats waits a second or more, and a
    loop that starts after such a pause runs in another state (on this 2-core VM a
    HEARTBEAT's p50 read 40 µs after one against 22 µs straight after a warm-up: the
    woken worker may be placed on the client's core), so its client times are not the
    p50s above, and are reported with the worker's they were measured beside."""
    from djinn.protocol.frames import Kind

    def step() -> tuple[int, ...]:
        t0 = clock()
        r = s.put(t)
        t1 = clock()
        r.cpu()
        t2 = clock()
        del r
        s._call(Kind.HEARTBEAT)
        return t1 - t0, t2 - t1, clock() - t2

    return split(client, iterations, step, ("put", "get", "heartbeat"))


def split(
    client: Client, iterations: int, step: Callable[[], tuple[int, ...]], names: Sequence[str]
) -> dict[str, Any]:
    """``step()`` ``iterations`` times, each returning the ns of its requests in turn: their
    latencies by ``names``, and the worker's mean µs by request kind over the same loop
    (``served_us``)."""
    before = worker_time(client)
    samples = [step() for _ in range(iterations)]
    out: dict[str, Any] = {n: latency([x[k] for x in samples]) for k, n in enumerate(names)}
    out["served_us"] = worker_time(client, since=before)
    return out


# -- the appliance's own share ------------------------------------------------------------------
STATS_SETTLE_S = 1.2  # a worker pushes its stats at least once a second (worker_stats.py)


def worker_time(client: Client, since: dict[str, Any] | None = None) -> dict[str, Any]:
    """The appliance's workers' own time per request kind, from dispatch to reply sent (the
    stats document's request accounting): running totals ``{kind: (count, seconds)}``, or
    with ``since`` (an earlier call's totals) the mean µs of each kind answered between
    the two, ``{kind: mean_us}``. What a client measured beyond it is the client's own
    Python and the transport. Workers push their stats at most once a second when idle,
    so this reads until two reads ``STATS_SETTLE_S`` apart agree."""
    import time

    def read() -> dict[str, tuple[int, float]]:
        totals: dict[str, tuple[int, float]] = {}
        for e in client.stats().get("requests", []):
            if e.get("worker") == "supervisor" or e.get("outcome") != "ok":
                continue
            count, secs = totals.get(e["kind"], (0, 0.0))
            totals[e["kind"]] = (count + int(e["count"]), secs + float(e["sum_s"]))
        return totals

    now = read()
    for _ in range(5):
        time.sleep(STATS_SETTLE_S)
        again = read()
        if again == now:
            break
        now = again
    if since is None:
        return now
    means: dict[str, float] = {}
    for kind, (count, secs) in now.items():
        c0, s0 = since.get(kind, (0, 0.0))
        if count > c0:
            means[kind] = round((secs - s0) / (count - c0) * 1e6, 2)
    return means


# -- bulk ---------------------------------------------------------------------------------------
def reps_for(nbytes: int, quick: bool) -> int:
    if nbytes <= 8 * MiB:
        return 10 if quick else 50
    if nbytes <= 256 * MiB:
        return 3 if quick else 10
    return 2 if quick else 5


def bulk_round(
    src: torch.Tensor, sessions: dict[str, Session], raw: dict[str, Peer], *, check: bool
) -> dict[str, list[float]]:
    """One timing of every path and ceiling, back to back, so that all of them see the
    same machine (interleaving rounds beats measuring each path in its own noisy slot).

    Memory stays at src + one arena slab + one result: the warm memcpy ceiling copies
    into the result a get has just produced (already faulted in), and the result and the
    remote tensor are dropped before the next path.
    """
    import torch

    got: dict[str, list[float]] = {}
    data = memoryview(src.numpy())
    for transport, peer in raw.items():
        got[f"socket_{transport}"] = [peer.stream(data)]
    data.release()
    for transport, s in sessions.items():
        t0 = clock()
        r = s.put(src)
        put_s = seconds_since(t0)
        t0 = clock()
        out = r.cpu()
        get_s = seconds_since(t0)
        t0 = clock()
        r.cpu(out=out)  # into a warm, preallocated buffer: no fresh pages to fault in
        get_into_s = seconds_since(t0)
        r.free()  # give the slab back before anything else runs
        if check and not torch.equal(out, src):
            raise AssertionError(f"bulk round trip over {transport} returned different bytes")
        for _ in range(MEMCPY_TRIES if src.numel() <= 64 * MiB else 1):
            t0 = clock()
            out.copy_(src)
            got.setdefault("memcpy", []).append(seconds_since(t0))
        del r, out
        got[f"put_{transport}"] = [put_s]
        got[f"get_{transport}"] = [get_s]
        got[f"getinto_{transport}"] = [get_into_s]
        got[f"combined_{transport}"] = [put_s + get_s]
        got[f"combinedinto_{transport}"] = [put_s + get_into_s]
    t0 = clock()
    fresh = torch.empty_like(src)
    fresh.copy_(src)
    got["alloc_memcpy"] = [seconds_since(t0)]
    del fresh
    return got


def bulk_size(
    nbytes: int, quick: bool, sessions: dict[str, Session], raw: dict[str, Peer]
) -> dict[str, Any]:
    import torch

    reps = reps_for(nbytes, quick)
    note(f"bulk {fmt_bytes(nbytes)}: 1 warm-up + {reps} interleaved rounds")
    src = torch.arange(256, dtype=torch.uint8).repeat(-(-nbytes // 256))[:nbytes].clone()
    bulk_round(src, sessions, raw, check=True)  # warm-up and a correctness check
    times: dict[str, list[float]] = {}
    for _ in range(reps):
        gc.collect()
        for key, values in bulk_round(src, sessions, raw, check=False).items():
            times.setdefault(key, []).extend(values)
    del src
    memcpy = {"warm": rate(nbytes, times["memcpy"]), "fresh": rate(nbytes, times["alloc_memcpy"])}
    sockets = {t: rate(nbytes, times[f"socket_{t}"]) for t in raw}
    paths: dict[str, Any] = {}
    for t in sessions:
        combined = rate(2 * nbytes, times[f"combined_{t}"])
        paths[t] = {
            "put": rate(nbytes, times[f"put_{t}"]),
            "get": rate(nbytes, times[f"get_{t}"]),
            "get_into": rate(nbytes, times[f"getinto_{t}"]),
            "combined": combined,
            "vs_memcpy": ratio(combined["best_gbps"], memcpy["warm"]["best_gbps"]),
            "into_vs_memcpy": ratio(
                rate(2 * nbytes, times[f"combinedinto_{t}"])["best_gbps"],
                memcpy["warm"]["best_gbps"],
            ),
            "vs_socket": ratio(combined["best_gbps"], sockets[t]["best_gbps"]),
        }
    out = {"bytes": nbytes, "reps": reps, "memcpy": memcpy, "raw_socket": sockets, "djinn": paths}
    if nbytes <= BACK_TO_BACK_MAX:
        out["back_to_back"] = back_to_back(nbytes, quick, sessions)
    return out


BACK_TO_BACK_MAX = 8 * MiB


def back_to_back(nbytes: int, quick: bool, sessions: dict[str, Session]) -> dict[str, Any]:
    """put+get of ``nbytes`` again and again with nothing between, as a loop that moves
    tensors does, beside memcpy timed the same way. The interleaved rounds time each
    request after other work: on the VM this was written on, the same Python costs 2-3x
    as much after a 10 ms pause as back to back (caches and the CPU's clock), and that
    cold cost, not the bytes, dominates a 1 MiB request there."""
    import torch

    count = 50 if quick else 200
    src = torch.arange(256, dtype=torch.uint8).repeat(-(-nbytes // 256))[:nbytes].clone()
    out = torch.empty_like(src)
    got: dict[str, Any] = {}
    for transport, s in sessions.items():
        for wait in (True, False):  # False: the put `x.to(remote)` makes
            times = []
            for i in range(count + 10):
                t0 = clock()
                r = s.put(src, wait=wait)
                r.cpu(out=out)
                took = seconds_since(t0)
                r.free()
                del r
                if i >= 10:  # warm-up
                    times.append(took)
            got[transport if wait else f"{transport} unwaited"] = rate(2 * nbytes, times)
    for transport, s in sessions.items():  # after every timed loop (split_tiny says why)

        def step(s: Session = s) -> tuple[int, ...]:
            t0 = clock()
            r = s.put(src)
            t1 = clock()
            r.cpu(out=out)
            t2 = clock()
            r.free()
            return t1 - t0, t2 - t1

        got[f"{transport} split"] = split(s.client, count, step, ("put", "get"))
    copies = []
    for _ in range(count):
        t0 = clock()
        out.copy_(src)
        copies.append(seconds_since(t0))
    got["memcpy"] = rate(nbytes, copies)
    got["count"] = count
    return got
