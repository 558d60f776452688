"""Issue 17 §5: crash-loop back-off forgives a worker that has been healthy a while.

Killed every half minute by a neighbour's bad request, a worker's restart wait climbed
to the maximum and stayed there. The wait must double only while the worker keeps dying
before it was healthy for ``restart_backoff_reset`` seconds, and start over after.
"""

from __future__ import annotations

from djinn.appliance import workers
from djinn.appliance.workers import FIRST_BACKOFF_S, WorkerHandle

MAX = 30.0
RESET = 20.0


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class _DeadProc:
    def kill(self) -> None:
        pass

    def wait(self) -> int:
        return -9


def _live(w: WorkerHandle, clock: _Clock, healthy_for: float) -> None:
    """The worker starts, reports ready, and runs ``healthy_for`` seconds."""
    w.alive, w.proc = True, _DeadProc()
    w.started_at = clock.now
    w.ready_at = clock.now + 2.0  # start-up takes a couple of seconds
    clock.now += 2.0 + healthy_for


def test_back_off_doubles_in_a_crash_loop_and_resets_after_a_healthy_spell(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(workers.time, "monotonic", clock)
    w = WorkerHandle(0, "cpu", {})
    waits = []
    for _ in range(7):  # dies every few seconds: a crash loop
        _live(w, clock, healthy_for=1.0)
        w.mark_dead(MAX, RESET)
        waits.append(w.backoff_s)
        clock.now += w.backoff_s
    assert waits == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0]
    for _ in range(5):  # then killed now and then, each time after a healthy half minute
        _live(w, clock, healthy_for=RESET + 10)
        w.mark_dead(MAX, RESET)
        assert w.backoff_s == FIRST_BACKOFF_S
        clock.now += w.backoff_s


def test_the_reset_time_is_a_documented_setting():
    from djinn.config import SETTINGS

    keys = {s.key for s in SETTINGS}
    assert "restart_backoff_reset" in keys
