#!/usr/bin/env python
"""Transport benchmark: tiny round trips and bulk put/get against ceilings in the same run.

Starts its own appliance (``djinn serve`` with a private config in a temporary
directory), then measures, each beside the ceiling it should be judged against
(DESIGN.md §7: ratios in the same run, never absolute times):

- tiny put+get round trip of a 4-element float32 tensor over unix and tcp (p50/p99, each
  half alone, and a bare HEARTBEAT as the protocol floor), against a raw 64-byte socket
  ping-pong between two processes (Unix socketpair and TCP loopback);
- bulk put+get of 1 MiB, 64 MiB and 1 GiB over unix (host arena) and tcp (payload),
  against ``dst.copy_(src)`` of the same bytes and a raw one-way socket stream
  (``sendall`` / ``recv_into`` between two processes) of the same byte count.

Prints markdown tables to stdout and writes a JSON document (``--json``). The raw-socket
peer is this same file run with ``--peer`` (torch is imported lazily, so it starts fast).

    python benchmarks/transport.py            # full run (~1-2 minutes)
    python benchmarks/transport.py --quick    # smoke run: fewer iterations, no 1 GiB
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import re
import secrets
import select
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from djinn.runtime.client import Client
    from djinn.runtime.session import Session

MiB = 1 << 20
GiB = 1 << 30
PING_BYTES = 64
READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
DEFAULT_SIZES = "1MiB,64MiB,1GiB"
QUICK_SIZES = "1MiB,64MiB"
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "transport.json"
TRANSPORTS = ("unix", "tcp")

# Design targets and a quoted (not measured) peer, printed as reference lines.
TARGET_ARENA_VS_MEMCPY = 0.5  # arena bulk put+get >= 0.5x memcpy
TARGET_TINY_UNIX_P50_US = 100.0  # tiny round trip over unix, p50
RPC_TINY_P50_US = 330.0  # torch.distributed.rpc, tiny round trip p50 (quoted)
RPC_BULK_GBPS = 1.5  # torch.distributed.rpc bulk, upper bound (quoted)

# Small copies are timed a few times per round: a copy that is stalled by another
# process (a descheduled intra-op thread costs a whole time slice) is no ceiling.
MEMCPY_TRIES = 5
FOREIGN_CPU_WARN = 0.05  # warn when other processes took more of the machine than this

clock = time.perf_counter_ns


# -- small helpers ----------------------------------------------------------------------------
def fmt_bytes(n: int) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def parse_sizes(text: str) -> list[int]:
    from djinn.config import parse_bytes

    sizes = [parse_bytes(part) for part in text.split(",") if part.strip()]
    if not sizes or any(n <= 0 for n in sizes):
        raise argparse.ArgumentTypeError(f"--sizes needs positive sizes, got {text!r}")
    return sizes


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


def note(msg: str) -> None:
    print(f"[transport] {msg}", file=sys.stderr, flush=True)


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise EOFError("peer closed the connection")
        got += n


# -- raw-socket peer (a separate process; no torch) -------------------------------------------
_CMD = struct.Struct("<cQ")  # command, argument
SINK_RING = 64 * MiB  # the peer's receive buffer: warm, reused, at most this big


def peer_main(transport: str, where: str) -> int:
    """Serve the parent's commands on one socket until it closes.

    ``P n``: echo n messages of PING_BYTES, blocking recv. ``S n``: receive n bytes with
    ``recv_into`` (into one warm buffer of min(n, SINK_RING) bytes, reused round-robin, so
    a 1 GiB stream does not cost the peer 1 GiB of memory), then ack one byte.
    """
    if transport == "unix":
        sock = socket.socket(fileno=int(where))
    else:
        sock = socket.create_connection(("127.0.0.1", int(where)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    head = memoryview(bytearray(_CMD.size))
    ping = memoryview(bytearray(PING_BYTES))
    ring = memoryview(bytearray())
    try:
        while True:
            recv_exact(sock, head)
            cmd, arg = _CMD.unpack(head)
            if cmd == b"P":
                for _ in range(arg):
                    recv_exact(sock, ping)
                    sock.sendall(ping)
            elif cmd == b"S":
                if len(ring) < min(arg, SINK_RING):
                    ring.release()
                    ring = memoryview(bytearray(min(arg, SINK_RING)))
                left = arg
                while left:
                    chunk = min(left, len(ring))
                    recv_exact(sock, ring[:chunk])
                    left -= chunk
                sock.sendall(b"k")
    except (EOFError, ConnectionError):
        return 0
    finally:
        sock.close()


class Peer:
    """The parent's end of a raw-socket peer process (Unix socketpair or TCP loopback)."""

    def __init__(self, transport: str) -> None:
        self.transport = transport
        argv = [sys.executable, str(Path(__file__).resolve()), "--peer", transport]
        if transport == "unix":
            self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            with theirs:
                self.proc = subprocess.Popen(
                    [*argv, str(theirs.fileno())],
                    pass_fds=(theirs.fileno(),),
                    stdin=subprocess.DEVNULL,
                )
        else:
            with socket.create_server(("127.0.0.1", 0)) as listener:
                port = listener.getsockname()[1]
                self.proc = subprocess.Popen([*argv, str(port)], stdin=subprocess.DEVNULL)
                listener.settimeout(30)
                self.sock, _ = listener.accept()
            self.sock.settimeout(None)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._ack = memoryview(bytearray(1))

    def ping_pong(self, iterations: int, warmup: int) -> list[int]:
        msg = memoryview(bytes(range(PING_BYTES)))
        back = memoryview(bytearray(PING_BYTES))
        self.sock.sendall(_CMD.pack(b"P", warmup + iterations))
        samples: list[int] = []
        for i in range(warmup + iterations):
            t0 = clock()
            self.sock.sendall(msg)
            recv_exact(self.sock, back)
            t1 = clock()
            if i >= warmup:
                samples.append(t1 - t0)
        return samples

    def stream(self, data: memoryview) -> float:
        """Seconds to push ``data`` to the peer until it has received every byte."""
        self.sock.sendall(_CMD.pack(b"S", data.nbytes))
        t0 = clock()
        self.sock.sendall(data)
        recv_exact(self.sock, self._ack)
        return (clock() - t0) / 1e9

    def close(self) -> None:
        self.sock.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@contextlib.contextmanager
def peers() -> Iterator[dict[str, Peer]]:
    started: dict[str, Peer] = {}
    try:
        for transport in TRANSPORTS:
            started[transport] = Peer(transport)
        yield started
    finally:
        for peer in started.values():
            peer.close()


# -- the appliance ------------------------------------------------------------------------------
@dataclass
class Appliance:
    proc: subprocess.Popen[str]
    unix: str
    tcp: str
    token: str
    readiness: str
    log_path: Path

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return self.proc.returncode

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string


@contextlib.contextmanager
def appliance(workdir: Path, arena_bytes: int, gpus: str) -> Iterator[Appliance]:
    """``djinn serve`` with a private socket, an ephemeral TCP port and a fresh token;
    stopped with SIGTERM on the way out, whatever happens."""
    token = "bench-" + secrets.token_hex(16)
    settings: dict[str, object] = {
        "socket_path": str(workdir / "djinn.sock"),
        "tcp_enabled": True,
        "tcp_host": "127.0.0.1",
        "tcp_port": 0,
        "token": token,
        "arena_bytes": arena_bytes,
        "gpus": gpus,
        # A 1 GiB TCP frame can keep a request in flight for seconds: a generous lease.
        "heartbeat_interval": 1.0,
        "heartbeat_misses": 30,
        "log_level": "warning",
    }
    config = workdir / "djinn.toml"
    config.write_text("".join(f"{k} = {toml_value(v)}\n" for k, v in settings.items()))
    log_path = workdir / "serve.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DJINN_")}
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "djinn.cli.main", "serve", "--config", str(config)],
            stdout=subprocess.PIPE,
            stderr=log,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env,
            cwd=workdir,
        )
    app = Appliance(proc, "", "", token, "", log_path)
    try:
        line = wait_ready(proc)
        unix = re.search(r"\bunix=(\S+)", line)
        tcp = re.search(r"\btcp=(\S+)", line)
        if unix is None or tcp is None:
            raise RuntimeError(f"unexpected readiness line: {line!r}")
        app.unix, app.tcp, app.readiness = f"unix://{unix[1]}", f"tcp://{tcp[1]}", line
        yield app
    except BaseException:
        tail = app.log_tail()
        if tail:
            note(f"appliance log (last lines):\n{tail}")
        raise
    finally:
        code = app.stop()
        note(f"appliance stopped (exit {code})")


def wait_ready(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        readable, _, _ = select.select([proc.stdout], [], [], 0.2)
        if readable:
            line = proc.stdout.readline()
            if line.startswith("djinn ready"):
                return line.strip()
            if not line and proc.poll() is not None:
                break
        elif proc.poll() is not None:
            break
    raise RuntimeError(f"djinn serve did not become ready (exit code {proc.poll()})")


def connect(app: Appliance, transport: str) -> Client:
    from djinn.runtime.client import Client

    # Client directly, not djinn.connect: no config lookup, no embedded fallback.
    return Client(app.unix) if transport == "unix" else Client(app.tcp, app.token)


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
        beat_ns: list[int] = []
        for _ in range(warmup):
            s._call(Kind.HEARTBEAT)
        for _ in range(iterations):
            t0 = clock()
            s._call(Kind.HEARTBEAT)
            beat_ns.append(clock() - t0)
    return {
        "roundtrip": latency([p + g for p, g in zip(put_ns, get_ns, strict=True)]),
        "put": latency(put_ns),
        "get": latency(get_ns),
        "heartbeat": latency(beat_ns),
    }


# -- bulk ---------------------------------------------------------------------------------------
def reps_for(nbytes: int, quick: bool) -> int:
    if nbytes <= 8 * MiB:
        return 10 if quick else 50
    if nbytes <= 256 * MiB:
        return 3 if quick else 10
    return 2 if quick else 5


def seconds_since(t0: int) -> float:
    return (clock() - t0) / 1e9


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
    return {"bytes": nbytes, "reps": reps, "memcpy": memcpy, "raw_socket": sockets, "djinn": paths}


# -- report -------------------------------------------------------------------------------------
def md_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(headers), sep, *(line(r) for r in rows)])


def render(doc: dict[str, Any]) -> str:
    out: list[str] = []
    tiny = doc["tiny"]
    host = doc["host"]
    out.append(f"# Djinn transport benchmark ({doc['appliance']['device']})")
    out.append("")
    out.append(
        f"{host['cpus']} CPUs, torch {host['torch']} ({host['torch_threads']} intra-op "
        f"threads), Python {host['python']}; {doc['elapsed_s']} s"
    )
    foreign = host.get("foreign_cpu_share")
    if foreign is not None and foreign > FOREIGN_CPU_WARN:
        out.append(
            f"**Warning: other processes used {foreign:.0%} of the CPUs during this run; "
            "absolute numbers are unreliable (ratios, taken in interleaved rounds, less so).**"
        )
    out.append("")
    out.append(
        f"## Tiny put+get round trip (4 x float32), µs; {tiny['iterations']} iterations "
        f"after {tiny['warmup']} warm-up"
    )
    out.append("")
    rows = []
    for transport in TRANSPORTS:
        d, c = tiny["djinn"][transport], tiny["raw_ping_pong"][transport]
        rows.append(
            [
                transport,
                f"{d['roundtrip']['p50_us']:.1f}",
                f"{d['roundtrip']['p99_us']:.1f}",
                f"{d['put']['p50_us']:.1f}",
                f"{d['get']['p50_us']:.1f}",
                f"{d['heartbeat']['p50_us']:.1f}",
                f"{c['p50_us']:.1f}",
                f"{c['p99_us']:.1f}",
                f"{tiny['roundtrip_vs_ping_pong'][transport]:.1f}x",
            ]
        )
    headers = [
        "path",
        "put+get p50",
        "put+get p99",
        "put p50",
        "get p50",
        "HEARTBEAT p50",
        "raw ping-pong p50",
        "raw p99",
        "put+get / raw",
    ]
    out.append(md_table(headers, rows))
    out.append("")
    out.append(
        "Raw ping-pong: 64-byte message between two processes, blocking recv "
        "(unix = socketpair, tcp = loopback, TCP_NODELAY). A put+get is two requests."
    )
    out.append("")
    out.append("## Bulk put+get, GB/s (1e9 B/s): best of reps (median); ratios use best-of put+get")
    out.append("")
    rows = []
    for item in doc["bulk"]:
        memcpy = item["memcpy"]
        for transport in TRANSPORTS:
            d = item["djinn"][transport]
            sock = item["raw_socket"][transport]
            rows.append(
                [
                    f"{fmt_bytes(item['bytes'])} x{item['reps']}",
                    "unix (arena)" if transport == "unix" else "tcp (payload)",
                    gbps(d["put"]),
                    gbps(d["get"]),
                    gbps(d["get_into"]),
                    gbps(d["combined"]),
                    gbps(memcpy["warm"]),
                    gbps(memcpy["fresh"]),
                    f"{sock['best_gbps']:.2f} ({transport})",
                    f"{d['vs_memcpy']:.2f}x",
                    f"{d['vs_socket']:.2f}x",
                ]
            )
    headers = [
        "size",
        "path",
        "put",
        "get",
        "get (out=)",
        "put+get",
        "memcpy",
        "alloc+memcpy",
        "raw socket",
        "/ memcpy",
        "/ socket",
    ]
    out.append(md_table(headers, rows))
    out.append("")
    out.append(
        "Rounds are interleaved: every path and ceiling is timed once per round. "
        "memcpy = dst.copy_(src) into a warm buffer (the result a get just produced); "
        "alloc+memcpy = into a fresh torch.empty (as a get's result must be); "
        "get (out=) = `r.cpu(out=buffer)` into a warm preallocated tensor; "
        "raw socket = one-way sendall/recv_into stream of the same bytes between two "
        "processes (receiver reuses a warm buffer of at most 64 MiB)."
    )
    out.append("")
    out.append("## Design targets (DESIGN.md §7) and references")
    out.append("")
    for check in doc["targets"]:
        mark = {True: "met", False: "MISSED", None: "ref"}[check["met"]]
        out.append(f"- [{mark}] {check['target']}: {check['measured']}")
    return "\n".join(out)


def gbps(r: dict[str, float]) -> str:
    return f"{r['best_gbps']:.2f} ({r['median_gbps']:.2f})"


def targets(doc: dict[str, Any]) -> list[dict[str, Any]]:
    checks: list[dict[str, Any]] = []
    for item in doc["bulk"]:
        v = item["djinn"]["unix"]["vs_memcpy"]
        checks.append(
            {
                "target": f"arena bulk put+get >= {TARGET_ARENA_VS_MEMCPY}x memcpy "
                f"({fmt_bytes(item['bytes'])})",
                "measured": f"{v:.3f}x",
                "met": v >= TARGET_ARENA_VS_MEMCPY,
            }
        )
    for item in doc["bulk"]:
        v = item["djinn"]["unix"]["into_vs_memcpy"]
        checks.append(
            {
                "target": f"arena put + get(out=) >= {TARGET_ARENA_VS_MEMCPY}x memcpy "
                f"({fmt_bytes(item['bytes'])}; a fresh result is bound by page faults, "
                "see alloc+memcpy)",
                "measured": f"{v:.3f}x",
                "met": v >= TARGET_ARENA_VS_MEMCPY,
            }
        )
    p50 = doc["tiny"]["djinn"]["unix"]["roundtrip"]["p50_us"]
    checks.append(
        {
            "target": f"tiny round trip <= {TARGET_TINY_UNIX_P50_US:.0f} µs p50 over unix",
            "measured": f"{p50:.1f} µs",
            "met": p50 <= TARGET_TINY_UNIX_P50_US,
        }
    )
    best_bulk = max(
        (item["djinn"][t]["combined"]["best_gbps"] for item in doc["bulk"] for t in TRANSPORTS),
        default=0.0,
    )
    checks.append(
        {
            "target": f"reference, quoted not measured: torch.distributed.rpc ~"
            f"{RPC_TINY_P50_US:.0f} µs tiny p50, < {RPC_BULK_GBPS} GB/s bulk",
            "measured": f"djinn unix tiny p50 {p50:.1f} µs "
            f"({RPC_TINY_P50_US / p50:.1f}x faster than the quote); "
            f"best djinn bulk put+get {best_bulk:.2f} GB/s",
            "met": None,
        }
    )
    return checks


# -- main ---------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    sizes: list[int] = args.sizes
    iterations: int = args.iterations
    warmup = max(20, iterations // 10)
    arena_bytes = -(-(max(sizes) + 256 * MiB) // MiB) * MiB
    started = time.monotonic()
    cpu_before = cpu_seconds()
    doc: dict[str, Any] = {
        "benchmark": "transport",
        "schema": 1,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "quick": args.quick,
        "host": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
        },
    }
    with tempfile.TemporaryDirectory(prefix="djinn-bench-") as tmp:
        note(f"starting djinn serve (arena {fmt_bytes(arena_bytes)})")
        with appliance(Path(tmp), arena_bytes, args.gpus) as app:
            note(app.readiness)
            device = re.search(r"\[(.*)\]", app.readiness)
            doc["appliance"] = {
                "readiness": app.readiness,
                "device": device[1] if device else "?",
                "arena_bytes": arena_bytes,
            }
            clients = {t: connect(app, t) for t in TRANSPORTS}
            try:
                tiny: dict[str, Any] = {"iterations": iterations, "warmup": warmup, "djinn": {}}
                for transport, client in clients.items():
                    note(f"tiny round trips over {transport} ({iterations} iterations)")
                    tiny["djinn"][transport] = tiny_djinn(client, iterations, warmup)
                with peers() as raw:
                    note("raw socket ping-pong")
                    tiny["raw_ping_pong"] = {
                        t: latency(p.ping_pong(iterations, warmup)) for t, p in raw.items()
                    }
                    tiny["roundtrip_vs_ping_pong"] = {
                        t: ratio(
                            tiny["djinn"][t]["roundtrip"]["p50_us"],
                            tiny["raw_ping_pong"][t]["p50_us"],
                        )
                        for t in TRANSPORTS
                    }
                    doc["tiny"] = tiny
                    with contextlib.ExitStack() as stack:
                        sessions = {t: stack.enter_context(c.session()) for t, c in clients.items()}
                        doc["appliance"]["inline_max"] = sessions["unix"].inline_max
                        doc["bulk"] = [bulk_size(n, args.quick, sessions, raw) for n in sizes]
            finally:
                for client in clients.values():
                    client.close()
    elapsed = time.monotonic() - started
    cpu_after = cpu_seconds()
    if cpu_before and cpu_after:
        foreign = (cpu_after[0] - cpu_before[0]) - (cpu_after[1] - cpu_before[1])
        share = max(0.0, foreign / (elapsed * (os.cpu_count() or 1)))
        doc["host"]["foreign_cpu_share"] = round(share, 3)
    doc["targets"] = targets(doc)
    doc["elapsed_s"] = round(elapsed, 1)
    return doc


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Djinn transport benchmark: tiny round trips and bulk put/get vs ceilings."
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: fewer iterations, no 1 GiB"
    )
    parser.add_argument(
        "--sizes",
        type=parse_sizes,
        default=None,
        help=f"bulk sizes, comma separated (default {DEFAULT_SIZES}; --quick: {QUICK_SIZES})",
    )
    parser.add_argument(
        "--iterations",
        type=int,
        default=None,
        help="tiny round-trip iterations after warm-up (default 2000; --quick: 200)",
    )
    parser.add_argument(
        "--json",
        default=str(DEFAULT_JSON),
        metavar="PATH",
        help="where to write the JSON document ('-': print it after the tables)",
    )
    parser.add_argument(
        "--gpus", default="auto", help="the appliance's gpus setting (default auto)"
    )
    args = parser.parse_args(argv)
    if args.sizes is None:
        args.sizes = parse_sizes(QUICK_SIZES if args.quick else DEFAULT_SIZES)
    if args.iterations is None:
        args.iterations = 200 if args.quick else 2000
    if args.iterations < 1:
        parser.error("--iterations must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)

    def on_sigterm(signum: int, _frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)  # unwind, so the appliance is stopped

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        doc = run(args)
    except KeyboardInterrupt:
        note("interrupted")
        return 130
    print(render(doc))
    text = json.dumps(doc, indent=2, ensure_ascii=False)
    if args.json == "-":
        print()
        print(text)
    else:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
        note(f"wrote {path}")
    return 0


def _entry(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "--peer":
        return peer_main(argv[1], argv[2])
    return main(argv)


if __name__ == "__main__":
    sys.exit(_entry(sys.argv[1:]))
