"""A fixed stats document (two GPU workers, three sessions, one model) for the snapshot
and the offline tests: what an appliance in use would answer, with nothing time-dependent
left to the local clock."""

from __future__ import annotations

import copy
from typing import Any

from djinn.appliance.reqstats import BUCKETS

GiB = 1 << 30
MiB = 1 << 20


def _buckets(**at: int) -> list[int]:
    """Histogram with n requests in the bucket whose upper bound is `b<seconds>`."""
    counts = [0] * (len(BUCKETS) + 1)
    for bound, n in at.items():
        counts[BUCKETS.index(float(bound[1:].replace("_", ".")))] = n
    return counts


def _seg(capacity: int, used: int, peak: int) -> dict[str, int]:
    return {"capacity": capacity, "used": used, "peak": peak}


def _worker(i: int, pid: int, sessions: int, util: int, restarts: int = 0) -> dict[str, Any]:
    return {
        "id": i,
        "device": f"cuda:{i} (NVIDIA H100 80GB HBM3)",
        "pid": pid,
        "alive": True,
        "ready": True,
        "restarts": restarts,
        "sessions": sessions,
        "uptime_s": 3600.0,
        "last_error": "",
        "utilisation": util,
    }


def _session(
    sid: str, worker: int, peer: str, age: float, beat: float, handles: int, nbytes: int, phase: str
) -> dict[str, Any]:
    return {
        "id": sid,
        "worker": worker,
        "peer": peer,
        "state": "open",
        "age_s": age,
        "last_heartbeat_s": beat,
        "handles": handles,
        "bytes": nbytes,
        "arena_leases": 0,
        "requests": 10,
        "phase": phase,
    }


FIRST: dict[str, Any] = {
    "schema": 1,
    "appliance": {
        "pid": 4242,
        "protocol": 1,
        "uptime_s": 3725.0,
        "addresses": {"unix": "unix:///run/djinn.sock", "tcp": "tcp://127.0.0.1:7070"},
    },
    "workers": [_worker(0, 4301, 2, 37), _worker(1, 4302, 1, 0, restarts=1)],
    "sessions": [
        {
            **_session(
                "9f2c41d07a3b6e15",
                0,
                "unix:pid=5120,uid=1000",
                812.4,
                0.3,
                14,
                3 * GiB,
                "llm_decode",
            ),
            "exec_share": 0.62,
            "class": "latency",
        },
        _session("03ab77e1c2d94f60", 0, "tcp:10.0.0.7:51234", 45.0, 1.2, 3, 96 * MiB, "forward"),
        _session("c7d0e5f6a1b2c3d4", 1, "unix:pid=5188,uid=1001", 3.5, 0.1, 0, 0, "unknown"),
    ],
    "vmu": {
        "host_arena": {
            "name": "/djinn-arena",
            "capacity": 2 * GiB,
            "used": 512 * MiB,
            "peak": 1536 * MiB,
            "pinned": True,
        },
        "devices": [
            {
                "worker": 0,
                "device": "cuda:0",
                "text": _seg(70 * GiB, 14 * GiB, 14 * GiB),
                "data": _seg(70 * GiB, 60 * GiB, 66 * GiB),
                "stack": _seg(35 * GiB, 0, 9 * GiB),
            },
            {
                "worker": 1,
                "device": "cuda:1",
                "text": _seg(70 * GiB, 0, 0),
                "data": _seg(70 * GiB, 1 * GiB, 2 * GiB),
                "stack": _seg(35 * GiB, 0, 0),
            },
        ],
    },
    "scheduler": [
        {
            "worker": 0,
            "policy": "semantic",
            "queued": 2,
            "batching": {"batches": 120, "calls": 384, "mean": 3.2, "largest": 4},
        },
        {"worker": 1, "policy": "semantic", "queued": 0, "batching": {"batches": 0, "mean": 0.0}},
    ],
    "models": [
        {
            "name": "gpt2",
            "fingerprint": "5d41402abc4b2a76b9719d911017c592",
            "bytes": 498 * MiB,
            "users": 2,
            "hits": 1311,
        },
    ],
    "requests": [
        {
            "kind": "EXECUTE",
            "outcome": "ok",
            "count": 1000,
            "sum_s": 20.0,
            "buckets": _buckets(b0_01=600, b0_025=390, b0_1=10),
            "worker": 0,
        },
        {
            "kind": "PUT",
            "outcome": "ok",
            "count": 200,
            "sum_s": 0.1,
            "buckets": _buckets(b0_0005=200),
            "worker": 1,
        },
        {
            "kind": "EXECUTE",
            "outcome": "RESOURCE_EXHAUSTED",
            "count": 2,
            "sum_s": 0.01,
            "buckets": _buckets(b0_005=2),
            "worker": 1,
        },
        {
            "kind": "HELLO",
            "outcome": "ok",
            "count": 50,
            "sum_s": 0.003,
            "buckets": _buckets(b0_0001=50),
            "worker": "supervisor",
        },
    ],
}


def later(doc: dict[str, Any], seconds: float, extra: dict[Any, int]) -> dict[str, Any]:
    """`doc` after `seconds`, with `extra[worker]` more requests on each worker's first series."""
    out = copy.deepcopy(doc)
    out["appliance"]["uptime_s"] += seconds
    seen: set[Any] = set()
    for series in out["requests"]:
        w = series["worker"]
        if w in extra and w not in seen:
            seen.add(w)
            series["count"] += extra[w]
            series["buckets"][next(i for i, n in enumerate(series["buckets"]) if n)] += extra[w]
    return out


# Two seconds later: 500 more requests on worker 0, 20 on worker 1, 2 on the supervisor.
SECOND = later(FIRST, 2.0, {0: 500, 1: 20, "supervisor": 2})
