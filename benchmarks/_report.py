"""The transport benchmark's report: the design targets checked against a result document,
and the markdown tables printed to stdout."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from _common import TRANSPORTS, fmt_bytes

# Design targets and a quoted (not measured) peer, printed as reference lines.
TARGET_ARENA_VS_MEMCPY = 0.5  # arena bulk put+get >= 0.5x memcpy
TARGET_TINY_UNIX_P50_US = 100.0  # tiny round trip over unix, p50
TARGET_BARE_VS_RAW = 2.0  # issue 11: a HEARTBEAT <= 2x the raw (blocking) ping-pong
TARGET_TINY_VS_RAW = 4.0  # issue 11: a tiny put+get <= 4x the raw ping-pong
TARGET_MIB_VS_MEMCPY = 0.3  # issue 11: 1 MiB put+get >= 0.3x memcpy
RPC_TINY_P50_US = 330.0  # torch.distributed.rpc, tiny round trip p50 (quoted)
RPC_BULK_GBPS = 1.5  # torch.distributed.rpc bulk, upper bound (quoted)

FOREIGN_CPU_WARN = 0.05  # warn when other processes took more of the machine than this


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
                f"{d['unwaited']['p50_us']:.1f} ({d['unwaited']['p50_us'] / c['p50_us']:.1f}x raw)",
                f"{d['heartbeat']['p50_us']:.1f}",
                f"{c['p50_us']:.1f}",
                f"{c['p99_us']:.1f}",
                f"{tiny['selected_ping_pong'][transport]['p50_us']:.1f}",
                f"{tiny['polling_ping_pong'][transport]['p50_us']:.1f}",
                f"{d['heartbeat']['p50_us'] / c['p50_us']:.1f}x",
                f"{tiny['roundtrip_vs_ping_pong'][transport]:.1f}x",
                f"{d['roundtrip']['p50_us'] / tiny['polling_ping_pong'][transport]['p50_us']:.1f}x",
            ]
        )
    headers = [
        "path",
        "put+get p50",
        "put+get p99",
        "put p50",
        "get p50",
        "put (not waited) + get p50",
        "HEARTBEAT p50",
        "raw ping-pong p50",
        "raw p99",
        "selector ping-pong p50",
        "polling ping-pong p50",
        "HEARTBEAT / raw",
        "put+get / raw",
        "put+get / polling",
    ]
    out.append(md_table(headers, rows))
    out.append("")
    out.append(
        "Raw ping-pong: 64-byte message between two processes, blocking recv "
        "(unix = socketpair, tcp = loopback, TCP_NODELAY). Selector ping-pong: the same, "
        "the echoing peer waiting in epoll on a non-blocking socket first, as a server of "
        "many sessions (the worker) must. Polling ping-pong: both ends poll a non-blocking "
        "recv and never sleep, as a client and worker that spin before sleeping do while "
        "answers come quickly (Note [spin before sleeping]; client_spin_us, "
        "worker_spin_us). A put+get is two requests."
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
    steady = [item for item in doc["bulk"] if "back_to_back" in item]
    if steady:
        out.append("")
        out.append("Back to back (a loop of put + get(out=) with nothing between), GB/s:")
        out.append("")
        rows = []
        for item in steady:
            b = item["back_to_back"]
            for transport in [t + w for t in TRANSPORTS for w in ("", " unwaited")]:
                best = b[transport]["best_gbps"]
                rows.append(
                    [
                        f"{fmt_bytes(item['bytes'])} x{b['count']}",
                        transport.replace("unwaited", "(put not waited)"),
                        gbps(b[transport]),
                        gbps(b["memcpy"]),
                        f"{best / b['memcpy']['best_gbps']:.3f}x",
                    ]
                )
        out.append(md_table(["size", "path", "put+get", "memcpy", "/ memcpy"], rows))
    out.append("")
    out.append(split_table(doc))
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


def split_table(doc: dict[str, Any]) -> str:
    """Where a request's time goes: what the client measured (mean µs) beside the worker's
    own time for the same requests, from dispatch to reply sent (the stats document's
    request accounting); the rest is the client's Python, its copies and the transport."""
    rows = []

    def row(what: str, transport: str, measured: float, served: float | None) -> None:
        rest = "" if served is None else f"{measured - served:.1f}"
        share = "" if served is None else f"{served / measured:.0%}"
        worker = "" if served is None else f"{served:.1f}"
        rows.append([what, transport, f"{measured:.1f}", worker, rest, share])

    for transport in TRANSPORTS:
        d = doc["tiny"]["djinn"][transport].get("split")
        if d is None:
            continue
        served = d.get("served_us") or {}
        row("tiny PUT", transport, d["put"]["mean_us"], served.get("PUT"))
        row("tiny GET", transport, d["get"]["mean_us"], served.get("GET"))
        row("HEARTBEAT", transport, d["heartbeat"]["mean_us"], served.get("HEARTBEAT"))
    for item in doc["bulk"]:
        for transport in TRANSPORTS:
            split = item.get("back_to_back", {}).get(f"{transport} split")
            if split is None:
                continue
            size = fmt_bytes(item["bytes"])
            served = split.get("served_us") or {}
            row(f"{size} PUT, back to back", transport, split["put"]["mean_us"], served.get("PUT"))
            row(f"{size} GET (out=), back to back", transport, split["get"]["mean_us"],
                served.get("GET"))  # fmt: skip
    headers = ["request", "path", "client µs", "worker µs", "client + transport µs", "worker share"]
    return "\n".join(
        [
            "Where a request's time goes (means, in loops of their own after the timed "
            "ones: reading the appliance's stats pauses, and a loop after a pause can run "
            "slower than the p50s above): the worker's own time from dispatch to reply "
            "sent, from the appliance's stats; the rest is the client's Python, its arena "
            "copies and the transport.",
            "",
            md_table(headers, rows),
        ]
    )


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
    tiny = doc["tiny"]
    for transport in TRANSPORTS:
        raw = tiny["raw_ping_pong"][transport]["p50_us"]
        beat = tiny["djinn"][transport]["heartbeat"]["p50_us"] / raw
        both = tiny["roundtrip_vs_ping_pong"][transport]
        checks.append(
            {
                "target": f"issue 11: a bare request (HEARTBEAT) <= {TARGET_BARE_VS_RAW:g}x "
                f"raw ping-pong ({transport})",
                "measured": f"{beat:.2f}x",
                "met": beat <= TARGET_BARE_VS_RAW,
            }
        )
        checks.append(
            {
                "target": f"issue 11: tiny put+get <= {TARGET_TINY_VS_RAW:g}x raw ping-pong "
                f"({transport})",
                "measured": f"{both:.2f}x",
                "met": both <= TARGET_TINY_VS_RAW,
            }
        )
        unwaited = tiny["djinn"][transport]["unwaited"]["p50_us"] / raw
        checks.append(
            {
                "target": f"issue 11: tiny put (not waited) + get <= {TARGET_TINY_VS_RAW:g}x "
                f"raw ping-pong ({transport})",
                "measured": f"{unwaited:.2f}x",
                "met": unwaited <= TARGET_TINY_VS_RAW,
            }
        )
    small = [item for item in doc["bulk"] if item["bytes"] == 1 << 20]
    for item in small:
        v = item["djinn"]["unix"]["vs_memcpy"]
        checks.append(
            {
                "target": f"issue 11: 1 MiB put+get >= {TARGET_MIB_VS_MEMCPY:g}x memcpy (unix)",
                "measured": f"{v:.3f}x",
                "met": v >= TARGET_MIB_VS_MEMCPY,
            }
        )
        b = item.get("back_to_back")
        for path, name in (("unix", "back to back"), ("unix unwaited", "put not waited")):
            if b is None:
                break
            v = b[path]["best_gbps"] / b["memcpy"]["best_gbps"]
            checks.append(
                {
                    "target": f"issue 11: 1 MiB put+get >= {TARGET_MIB_VS_MEMCPY:g}x memcpy "
                    f"(unix, {name})",
                    "measured": f"{v:.3f}x",
                    "met": v >= TARGET_MIB_VS_MEMCPY,
                }
            )
    p50 = tiny["djinn"]["unix"]["roundtrip"]["p50_us"]
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
