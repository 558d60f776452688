"""Note [puts sent without waiting]: what a worker session remembers of its failed PUTs
(appliance/sessions.py): bounded, well-formed names only, and no error object (whose
traceback would hold the request's payload)."""

from __future__ import annotations

import socket

import pytest

from appliance.sessions import FAILED_MESSAGE_MAX, FAILED_PUTS, WorkerSession
from djinn.errors import NotFound, QuotaExceeded


@pytest.fixture
def session():
    a, b = socket.socketpair()
    yield WorkerSession("s1", "peer", a, None, True, 10.0)
    a.close()
    b.close()


def test_a_failed_puts_names_raise_its_error_by_type(session):
    session.put_failed(["A" * 22, "B" * 22], QuotaExceeded("over session_device_max"))
    for name in ("A" * 22, "B" * 22):
        with pytest.raises(QuotaExceeded, match="its PUT failed: over session_device_max"):
            session.tensor(name)
    with pytest.raises(NotFound):
        session.tensor("C" * 22)
    assert all(type(v) is tuple for v in session.failed_puts.values())


def test_only_well_formed_names_are_remembered_and_only_the_last_ones(session):
    session.put_failed(["x" * (8 << 20), "short", None, 7], QuotaExceeded("no"))
    assert not session.failed_puts
    session.put_failed([f"{i:022d}" for i in range(FAILED_PUTS + 10)], QuotaExceeded("m" * 5000))
    assert len(session.failed_puts) == FAILED_PUTS
    assert f"{0:022d}" not in session.failed_puts  # the oldest went first
    assert all(len(m) == FAILED_MESSAGE_MAX for _, m in session.failed_puts.values())
