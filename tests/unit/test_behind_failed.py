"""Note [replays sent ahead]: the worker remembers which EXECs of a session failed, however
they were answered, and refuses an EXEC sent behind one of them (BEHIND_FAILED)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from appliance import handlers, parking
from appliance.sessions import FAILED_EXECS, WorkerSession
from djinn.errors import BehindFailed, InvalidArgument
from djinn.protocol.frames import Kind


def _session() -> WorkerSession:
    return WorkerSession(id="s", peer="unix", sock=None, reader=None, via_unix=True, lease_s=5.0)


def test_an_exec_refused_at_its_admission_deadline_counts_as_failed():
    """The admission queue answers a parked EXEC itself when its deadline passes (not
    through the dispatch that records failures): the graph sent behind it must not run."""
    s = _session()
    frame = SimpleNamespace(kind=Kind.EXEC, request_id=7)
    waiting = SimpleNamespace(session=s, frame=frame, since=0.0, short=1, message="short")
    answered: list[tuple[int, str]] = []
    worker = SimpleNamespace(
        admission=SimpleNamespace(expired=lambda now: [waiting], ready=lambda used: []),
        store=SimpleNamespace(vmu=SimpleNamespace(used=0)),
        send_error=lambda sess, rid, exc: answered.append((rid, exc.code)),
        _serve_buffered=lambda sess: None,
    )
    parking.admit(worker)
    assert answered == [(7, "RESOURCE_EXHAUSTED")]
    with pytest.raises(BehindFailed, match="request 7"):
        handlers._after_failed(s, {"after": 7})
    handlers._after_failed(s, {"after": 6})  # another request: runs


def test_only_failed_execs_are_remembered_and_the_last_few():
    s = _session()
    s.failed("PUT", 1)  # a failed put is named by its handles instead
    handlers._after_failed(s, {"after": 1})
    for rid in range(2, 2 + FAILED_EXECS + 1):
        s.failed("EXEC", rid)
    handlers._after_failed(s, {"after": 2})  # the oldest is forgotten
    with pytest.raises(BehindFailed):
        handlers._after_failed(s, {"after": 2 + FAILED_EXECS})
    handlers._after_failed(s, {})  # no "after": runs
    with pytest.raises(InvalidArgument):
        handlers._after_failed(s, {"after": "3"})
