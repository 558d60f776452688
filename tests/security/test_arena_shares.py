"""Issue 17 §4: one session cannot starve the others of the host arena.

A session that fills the arena (ALLOC leases over Unix, or PUTs received into slabs over
TCP) gets RESOURCE_EXHAUSTED once over its share; every other session can still PUT and
fetch a 1 MiB tensor.
"""

from __future__ import annotations

import pytest
import torch

from djinn.errors import ResourceExhausted
from djinn.protocol.frames import Kind

MIB = 1 << 20


def _hog_unix(s) -> int:
    """Lease 1 MiB slabs until refused; returns how many were granted."""
    n = 0
    with pytest.raises(ResourceExhausted):
        while n < 1000:
            s._call(Kind.ALLOC, {"sizes": [MIB]})
            n += 1
    return n


def _victim_works(app, via: str) -> None:
    with app.connect(via) as client, client.session() as s:
        t = torch.arange(MIB // 4, dtype=torch.float32)
        r = s.put(t)
        assert torch.equal(r.cpu(), t)
        assert torch.equal(r.cpu(), t)


def test_a_session_holding_the_arena_does_not_starve_the_others(fresh_appliance):
    app = fresh_appliance(cpu_workers=1, arena_bytes="64MiB")
    with app.connect("unix") as client, client.session() as hog:
        granted = _hog_unix(hog)
        assert granted < 64  # refused before the arena was full
        _victim_works(app, "unix")
        _victim_works(app, "tcp")


def test_two_hogs_still_leave_room_for_a_third_session(fresh_appliance):
    app = fresh_appliance(cpu_workers=1, arena_bytes="64MiB")
    c1, c2 = app.connect("unix"), app.connect("unix")
    with c1, c1.session() as a, c2, c2.session() as b:
        _hog_unix(a)
        _hog_unix(b)
        _victim_works(app, "unix")
        _victim_works(app, "tcp")


def test_tcp_uploads_count_against_the_uploaders_share(fresh_appliance):
    app = fresh_appliance(cpu_workers=1, arena_bytes="64MiB")
    with app.connect("tcp") as client, client.session() as hog:
        kept = []
        with pytest.raises(ResourceExhausted):
            for _ in range(64):
                kept.append(hog.put(torch.ones(MIB // 4)))
        _victim_works(app, "unix")
