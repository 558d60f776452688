"""Note [spin before sleeping]: polling before sleeping, only while answers come quickly,
and a client that still gives up on a silent appliance."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from djinn.errors import Unavailable
from djinn.protocol.frames import Kind
from djinn.runtime.channel import Channel
from djinn.transport import spin
from djinn.transport.address import parse_address
from djinn.transport.spin import Spin


@pytest.fixture
def two_cores(monkeypatch):
    monkeypatch.setattr(spin, "usable_cores", lambda: 2)


def counting(answers):
    """A ready-check that gives ``answers`` in turn (then its last), counting its calls."""
    calls = []

    def ready():
        calls.append(1)
        return answers[min(len(calls), len(answers)) - 1]

    return ready, calls


def test_polls_until_ready_and_gives_what_it_found(two_cores):
    s = Spin(100_000)  # 0.1 s: far longer than three polls
    ready, calls = counting([[], [], ["x"]])
    assert s.poll(ready) == ["x"]
    assert len(calls) == 3
    assert (s.spun, s.caught) == (1, 1)


def test_gives_up_after_its_window_or_limit(two_cores):
    s = Spin(2_000)  # 2 ms
    ready, calls = counting([[]])
    t0 = time.perf_counter()
    assert not s.poll(ready)
    assert time.perf_counter() - t0 >= 0.002
    assert len(calls) > 1
    ready, calls = counting([[]])
    assert not Spin(10_000_000).poll(ready, limit=0.0)  # a limit shorter than the window
    assert len(calls) == 1
    assert (s.spun, s.caught) == (1, 0)


def test_no_spinning_when_off_or_on_one_core(monkeypatch):
    ready, calls = counting([["x"]])
    assert Spin(0).poll(ready) is None
    monkeypatch.setattr(spin, "usable_cores", lambda: 1)
    assert Spin(200).window == 0.0
    assert Spin(200).poll(ready) is None
    assert calls == []


def test_a_slow_answer_turns_spinning_off_for_its_key_until_a_quick_one(two_cores):
    s = Spin(200)
    ready, calls = counting([["x"]])
    s.waited(1.0, "EXEC")  # a long graph: the next EXEC sleeps at once
    assert s.poll(ready, "EXEC") is None
    assert calls == []
    assert s.poll(ready, "GET") == ["x"]  # other kinds still poll
    s.waited(50e-6, "EXEC")  # one quick answer, even while sleeping, turns it back on
    assert s.poll(ready, "EXEC") == ["x"]


@pytest.fixture
def silent_channel(tmp_path):
    """A client channel (spinning) to a Unix socket that accepts and never answers."""
    path = str(tmp_path / "silent.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    held: list[socket.socket] = []
    accepting = threading.Thread(target=lambda: held.append(server.accept()[0]), daemon=True)
    accepting.start()
    ch = Channel(parse_address(f"unix://{path}"), Unavailable, spin_us=200)
    try:
        yield ch
    finally:
        ch.close()
        accepting.join(5)
        for s in held:
            s.close()
        server.close()


def test_a_client_waiting_on_a_silent_appliance_still_times_out(silent_channel):
    """The poll that replaces the blocking read keeps Note [client timeouts]: a reply that
    never comes ends the call with the connection-lost error, not a hang."""
    ch = silent_channel
    ch.sock.settimeout(0.3)
    t0 = time.perf_counter()
    with pytest.raises(Unavailable, match=r"no reply for 0\.3 s"):
        ch.call(Kind.HEARTBEAT)
    assert time.perf_counter() - t0 < 30  # gave up; did not wait forever
    assert ch.closed


def test_the_heartbeat_threads_check_never_collides_with_a_waiting_call(silent_channel):
    """The heartbeat thread asks ``reply_waiting`` without the channel's lock while a call
    may be waiting for its reply: a poll object shared between them raised "concurrent
    poll() invocation" in one of the two (a dead heartbeat thread, or a reply left unread
    and the next one taken for it)."""
    ch = silent_channel
    failures: list[BaseException] = []
    ended: list[BaseException] = []

    def call() -> None:
        try:
            ch.call(Kind.HEARTBEAT)
        except BaseException as exc:
            ended.append(exc)

    ch.sock.settimeout(1.0)
    waiting = threading.Thread(target=call, daemon=True)
    waiting.start()
    while waiting.is_alive():
        try:
            assert ch.reply_waiting() is False
        except BaseException as exc:
            failures.append(exc)
            break
        time.sleep(0.001)
    waiting.join(10)
    assert not failures
    assert len(ended) == 1 and isinstance(ended[0], Unavailable)  # its own timeout
