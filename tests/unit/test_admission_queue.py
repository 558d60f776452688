"""Note [admission queue]: a waiting request's deadline is its own. It was keyed by
``id(frame)``, and a frame answered on a path that did not forget its deadline (an
internal error) left the entry behind: a later request whose frame reused the freed
object's address inherited that old, passed deadline and was refused without waiting."""

from __future__ import annotations

import time
from types import SimpleNamespace

from djinn.appliance.admission import AdmissionQueue
from djinn.appliance.vmu.device import DeviceShort
from djinn.protocol.frames import Frame, Header, Kind


def _frame(rid: int) -> Frame:
    return Frame(Header(Kind.CALL, 0, rid, 0, 0), {}, [])


def test_a_new_request_never_inherits_the_deadline_of_an_old_one():
    q = AdmissionQueue(timeout_s=0.05)
    s = SimpleNamespace(id="s1")
    short = DeviceShort("device memory full", 100)
    first = _frame(1)
    assert q.park(s, first, short, used=1000)
    q.ready(0)  # memory was freed: taken out to run again ...
    time.sleep(0.1)  # ... and answered on a path that never called ran() (an internal
    # error), and the old request's deadline has passed. The next request's frame may be
    # a new object at the freed address (CPython reuses them, but not reliably enough for
    # a test: CI once found none in 10,000 tries): the same object, carrying the new
    # request, has that address for certain.
    frame = first
    frame.header = Header(Kind.CALL, 0, 2, 0, 0)
    assert q.park(s, frame, short, used=1000), "a fresh request was refused without waiting"


def test_a_sessions_end_forgets_every_deadline_it_had():
    q = AdmissionQueue(timeout_s=30)
    s = SimpleNamespace(id="s1")
    frame = _frame(1)
    assert q.park(s, frame, DeviceShort("full", 1), used=10)
    q.ready(0)  # taken out to run again when its session ended
    q.forget("s1")
    assert not q._deadlines
