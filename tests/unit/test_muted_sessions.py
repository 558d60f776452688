"""A session whose request is parked in the admission queue leaves the worker's selector
(appliance/parking.py): its socket, readable while a request its client sent behind the parked
one waits, would otherwise wake the loop at once, again and again."""

from __future__ import annotations

import selectors
import socket
from types import SimpleNamespace

from appliance import parking


def test_a_muted_session_does_not_wake_the_selector_and_comes_back_unmuted():
    a, b = socket.socketpair()
    try:
        worker = SimpleNamespace(sel=selectors.DefaultSelector())
        s = SimpleNamespace(sock=a, muted=False)
        worker.sel.register(a, selectors.EVENT_READ, s)
        b.sendall(b"a request behind the parked one")
        assert worker.sel.select(0)
        parking.mute(worker, s)
        parking.mute(worker, s)  # parked again: still muted, once
        assert s.muted and worker.sel.select(0) == []
        parking.unmute(worker, s)
        assert not s.muted and [k.data for k, _ in worker.sel.select(0)] == [s]
    finally:
        a.close()
        b.close()
