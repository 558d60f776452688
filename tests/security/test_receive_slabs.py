"""Issue 17 §1: a session's bulk receive state belongs to its connection.

A TCP client's PUT payload is received straight into an arena slab, over many reads.
Between those reads the worker serves other sessions; none of their frames may free,
reuse or overwrite the slab that is still being filled.
"""

from __future__ import annotations

import threading

import torch

from tests.conftest import wait_for

KIB = 1 << 10
MIB = 1 << 20


def _uploader(app, fill: float, nbytes: int, rounds: int, bad: list, errors: list) -> None:
    try:
        with app.connect("tcp") as client, client.session() as s:
            t = torch.full((nbytes // 4,), fill, dtype=torch.float32)
            for _ in range(rounds):
                back = s.put(t).cpu()
                wrong = int((back != fill).sum())
                if wrong:
                    bad.append((fill, wrong))
    except Exception as exc:  # reported by the test, not lost in a thread
        errors.append(repr(exc))


def test_two_tcp_sessions_putting_at_once_never_see_each_others_bytes(fresh_appliance):
    app = fresh_appliance(cpu_workers=1, arena_bytes="64MiB")
    bad: list = []
    errors: list = []
    threads = [
        threading.Thread(target=_uploader, args=(app, float(k + 1), 4 * MIB, 30, bad, errors))
        for k in range(4)
    ]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not errors
    assert bad == [], f"(fill, wrong elements) per corrupted read-back: {bad[:5]}"


def test_bulk_upload_survives_heartbeats_and_a_neighbours_puts(fresh_appliance):
    """The issue's second repro, scaled to the suite: a big TCP upload in flight while an
    idle session heartbeats as fast as it can and a third session PUTs 4 MiB of 7.0."""
    app = fresh_appliance(cpu_workers=1, arena_bytes="256MiB")
    stop = threading.Event()
    bad: list = []
    errors: list = []

    def heartbeater() -> None:
        from djinn.protocol.frames import Kind

        with app.connect("unix") as client, client.session() as s:
            while not stop.is_set():
                s._call(Kind.HEARTBEAT)

    def neighbour() -> None:
        with app.connect("tcp") as client, client.session() as s:
            seven = torch.full((MIB,), 7.0)
            while not stop.is_set():
                s.put(seven)

    side = [threading.Thread(target=heartbeater), threading.Thread(target=neighbour)]
    for th in side:
        th.start()
    try:
        _uploader(app, 1.5, 48 * MIB, 6, bad, errors)
    finally:
        stop.set()
        for th in side:
            th.join(60)
    assert not errors
    assert bad == []
    # Every receive slab went back to the arena once the sessions ended.
    wait_for(lambda: app.stats()["vmu"]["host_arena"]["used"] == 0, timeout=15)
