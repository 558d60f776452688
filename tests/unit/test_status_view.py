"""`djinn status` never crashes, and the stats document's session rows are whole while
a worker has not reported a session yet (issue 16 §1)."""

from __future__ import annotations

import pytest

from djinn.appliance import stats
from djinn.appliance.workers import WorkerHandle
from djinn.cli.status import render, worker_state


def _arena() -> dict:
    return {"name": "/djinn-test-arena", "size": 1 << 20}


def test_a_handed_over_session_is_a_whole_opening_row_until_the_worker_reports_it():
    w = WorkerHandle(0, "cpu:0", {})
    w.handed_over("s1", "unix:pid=1,uid=0")
    w.reported({"sessions": [], "adopted": 0})  # a busy worker's report: not adopted yet
    doc = stats.build([w], _arena(), 0.0, {})
    (row,) = doc["sessions"]
    assert row.keys() >= stats.opening_row("x", "y").keys() and row["state"] == "opening"
    assert row["worker"] == 0 and w.session_count() == 1
    text = render(doc)
    assert "opening" in text and "s1" in text
    w.reported({"sessions": [{**stats.opening_row("s1", "p"), "state": "open"}], "adopted": 1})
    doc = stats.build([w], _arena(), 0.0, {})
    assert [s["state"] for s in doc["sessions"]] == ["open"] and not w.opening


def test_a_session_closed_before_any_report_does_not_stay_opening():
    w = WorkerHandle(0, "cpu:0", {})
    w.handed_over("s1", "p")
    w.reported({"sessions": [], "adopted": 1})  # adopted and already gone
    assert stats.build([w], _arena(), 0.0, {})["sessions"] == []


@pytest.mark.parametrize(
    "doc",
    [
        {},
        {"appliance": {}, "workers": [{}], "sessions": [{}], "vmu": {"devices": [{}]}},
        {"workers": [{"alive": False}], "sessions": [{"id": "a", "age_s": None}]},
        {"latency": {"kinds": [{"kind": "EXEC", "count": 3}]}},
        {"workers": [{"busy": {}}], "sessions": None, "vmu": None, "models": None},
        {"scheduler": [{}, None, {"worker": 0, "queued": None}]},
    ],
)
def test_status_renders_partial_or_unexpected_documents(doc):
    assert "Workers" in render(doc)


def test_the_status_table_has_the_phase_and_state_columns():
    row = {**stats.opening_row("abc", "tcp:1.2.3.4:5"), "phase": "llm_decode", "worker": 0}
    text = render({"sessions": [row]})
    header = next(line for line in text.splitlines() if line.startswith("id "))
    assert "phase" in header and "state" in header
    assert "llm_decode" in text


def test_status_shows_each_workers_scheduler():
    row = {"worker": 0, "policy": "semantic", "queued": 2, "oldest_wait_s": 0.0125,
           "preemptions": 7, "longest_slice_s": 0.5}  # fmt: skip
    text = render({"scheduler": [row]})
    line = next(x for x in text.splitlines() if x.startswith("0 "))
    assert line.split()[:3] == ["0", "semantic", "2"] and "12.5ms" in line and "500ms" in line


@pytest.mark.parametrize(
    ("worker", "says"),
    [
        ({"busy": {"session": "abc", "kind": "EXEC", "for_s": 12.34}}, "busy 12.3s (EXEC"),
        ({"alive": False, "last_error": "exit code -9", "backoff_s": 2}, "DOWN (exit code -9)"),
        ({"ready": False}, "starting"),
        ({"stats_age_s": 9.5}, "no report for 9.5s"),
        ({"stats_age_s": 0.05}, "idle"),
    ],
)
def test_worker_state_says_what_the_worker_is_doing(worker, says):
    assert says in worker_state({"alive": True, "ready": True, **worker})
