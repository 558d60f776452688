"""Issue 17 §8: a worker gives back what a session used as soon as the session ends.

Note [no session cycles] (worker.py): a reference cycle through a session kept its reader
buffer and everything it referenced alive until a full garbage collection, and worker
RSS crept up with session churn. ``benchmarks/soak.py`` measures the RSS; this test pins
the cause: with the garbage collector off, an ended session is gone at once.
"""

from __future__ import annotations

import contextlib
import gc
import os
import socket
import uuid
import weakref

import pytest

from djinn.appliance.memtrim import trim_heap
from djinn.appliance.sessions import CLOSED, EXPIRED
from djinn.appliance.vmu import arena as arena_module
from djinn.appliance.vmu.arena import HostArenaSegment
from djinn.appliance.worker import Worker

MiB = 1 << 20


@pytest.fixture
def worker(monkeypatch, request):
    # one segment name per process is the appliance's rule; a test needs its own
    monkeypatch.setattr(arena_module, "segment_name", lambda: f"/djinn-test-{uuid.uuid4().hex}")
    arena = HostArenaSegment(8 * MiB)
    request.addfinalizer(arena.unlink)
    ctl, supervisor_end = socket.socketpair()
    init = {
        "op": "init",
        "worker": 0,
        "device": "cpu:0",
        "workers": 1,
        "arena_name": arena.name,
        "arena_size": arena.size,
        "arena_base": 0,
        "arena_share": arena.size,
        "inline_max": 64 << 10,
        "heartbeat_interval": 1.0,
        "lease_s": 3.0,
        "cpu_worker_memory": 64 * MiB,
        "text_fraction": 0.4,
        "data_fraction": 0.4,
    }
    supervisor_end.setblocking(False)
    w = Worker(ctl, init)
    yield w
    for s in list(w.sessions.values()):
        w.end_session(s, CLOSED)
    ctl.close()
    supervisor_end.close()
    with contextlib.suppress(Exception):
        w.arena.close()


def _adopt(worker: Worker, session_id: str) -> tuple[socket.socket, object]:
    client, server = socket.socketpair()
    worker.adopt(
        {"session": session_id, "peer": "test", "via_unix": True, "request_id": 1},
        os.dup(server.fileno()),
    )
    server.close()
    return client, next(s for s in worker.sessions.values() if s.id == session_id)


@pytest.mark.parametrize("how", [CLOSED, EXPIRED])
def test_an_ended_session_is_freed_by_reference_counting(worker, how):
    client, session = _adopt(worker, "s-" + how)
    reader = weakref.ref(session.reader)
    ref = weakref.ref(session)
    gc.disable()
    try:
        worker.end_session(session, how)
        if how == EXPIRED:  # a tombstone stays until its client goes away
            assert ref() is not None
            worker.end_session(session, CLOSED)
        del session
        assert ref() is None and reader() is None
    finally:
        gc.enable()
        client.close()


def test_the_heap_trim_is_available_and_harmless():
    # glibc: True when pages went back; elsewhere a no-op. Either way it must not raise.
    assert trim_heap() in (True, False)
