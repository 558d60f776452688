"""`djinn top` behaviour that needs no appliance: sorting, stable selection, defensive
reading of the document, the watermark bar and the request rate arithmetic."""

from __future__ import annotations

import copy
import math
import threading
from typing import Any

import pytest
from textual.pilot import Pilot

from djinn.tui.app import DjinnTop
from djinn.tui.widgets.confirm import ConfirmScreen
from djinn.tui.widgets.requests import TOTAL, RateTracker
from djinn.tui.widgets.table import SortableTable
from djinn.tui.widgets.watermark import EMPTY, FULL, PEAK, render_watermark

from .conftest import FakeSource, run, until
from .docs import FIRST, SECOND

pytestmark = pytest.mark.timeout(30)


def sessions_of(app: DjinnTop) -> SortableTable:
    return app.query_one("#sessions", SortableTable)


async def first_poll(pilot: Pilot) -> None:
    await until(pilot, lambda: pilot.app.polls >= 1)


def test_s_cycles_the_sort_column_and_keeps_the_selected_row():
    app = DjinnTop("unix:///x", refresh=3600, source=FakeSource([FIRST]))

    async def scenario(pilot: Pilot) -> None:
        await first_poll(pilot)
        table = sessions_of(app)
        assert table.row_keys() == sorted(table.row_keys())  # by id, A-Z
        table.move_cursor(row=table.get_row_index("9f2c41d07a3b6e15"))
        await pilot.press("s", "s", "s")  # id -> worker -> peer -> age (oldest first)
        assert table.border_subtitle == "sort: age ▼"
        assert table.row_keys() == ["9f2c41d07a3b6e15", "03ab77e1c2d94f60", "c7d0e5f6a1b2c3d4"]
        assert table.selected_key == "9f2c41d07a3b6e15"
        await pilot.press("S")
        assert table.row_keys()[0] == "c7d0e5f6a1b2c3d4"
        assert table.selected_key == "9f2c41d07a3b6e15"

    run(app, scenario)


def test_selection_follows_its_row_when_rows_come_and_go():
    newcomer = copy.deepcopy(FIRST["sessions"][0])
    newcomer["id"] = "000000000000000a"  # sorts first: pushes every other row down
    grown = copy.deepcopy(FIRST)
    grown["sessions"] = [newcomer, *grown["sessions"][1:]]  # and 9f2c... is gone
    app = DjinnTop("unix:///x", refresh=3600, source=FakeSource([FIRST, grown]))

    async def scenario(pilot: Pilot) -> None:
        await first_poll(pilot)
        table = sessions_of(app)
        table.move_cursor(row=table.get_row_index("c7d0e5f6a1b2c3d4"))
        await app.poll_once()
        assert table.row_keys() == ["000000000000000a", "03ab77e1c2d94f60", "c7d0e5f6a1b2c3d4"]
        assert table.selected_key == "c7d0e5f6a1b2c3d4"

    run(app, scenario)


def test_clicking_a_header_sorts_by_that_column():
    app = DjinnTop("unix:///x", refresh=3600, source=FakeSource([FIRST]))

    async def scenario(pilot: Pilot) -> None:
        await first_poll(pilot)
        table = sessions_of(app)
        label = table.columns["bytes"].label
        table.post_message(SortableTable.HeaderSelected(table, "bytes", 6, label))
        await pilot.pause()
        assert table.row_keys()[0] == "9f2c41d07a3b6e15"  # 3 GiB: biggest first
        assert table.border_subtitle == "sort: bytes ▼"

    run(app, scenario)


def test_k_asks_first_and_only_yes_ends_the_session():
    source = FakeSource([FIRST])
    app = DjinnTop("unix:///x", refresh=3600, source=source)

    async def scenario(pilot: Pilot) -> None:
        await first_poll(pilot)
        table = sessions_of(app)
        table.move_cursor(row=table.get_row_index("03ab77e1c2d94f60"))
        await pilot.press("k")
        await until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press("escape")
        await until(pilot, lambda: not isinstance(app.screen, ConfirmScreen))
        assert source.killed == []
        await pilot.press("k")
        await until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press("y")
        await until(pilot, lambda: source.killed == ["03ab77e1c2d94f60"])

    run(app, scenario)


class DownSource(FakeSource):
    @property
    def connected(self) -> bool:
        return False

    def poll(self) -> dict[str, Any] | None:
        self.error = "[UNAVAILABLE] cannot reach the appliance"
        return None


def test_an_unreachable_appliance_says_disconnected_and_kill_needs_a_session():
    app = DjinnTop("unix:///nowhere", refresh=3600, source=DownSource([FIRST]))

    async def scenario(pilot: Pilot) -> None:
        await first_poll(pilot)
        assert "disconnected" in app.status_text
        assert "cannot reach" in app.status_text
        await pilot.press("k")  # nothing selected: a warning, no dialog
        await pilot.pause()
        assert not isinstance(app.screen, ConfirmScreen)

    run(app, scenario)


class FrozenSource(FakeSource):
    """An appliance that accepted the connection and then never answers."""

    def __init__(self) -> None:
        super().__init__([FIRST])
        self.release = threading.Event()

    def poll(self) -> dict[str, Any] | None:
        self.release.wait(30)
        return None


def test_a_frozen_appliance_shows_not_responding_and_q_still_quits():
    source = FrozenSource()
    app = DjinnTop("unix:///frozen", refresh=0.05, source=source)
    app.stall_s = 0.3

    async def scenario(pilot: Pilot) -> None:
        await until(pilot, lambda: "not responding" in app.status_text, timeout=5)
        await pilot.press("q")  # must not wait for the stuck poll

    try:
        run(app, scenario)
        assert app.return_code == 0
    finally:
        source.release.set()


def test_a_sparse_document_renders_with_defaults():
    sparse = {
        "appliance": {},
        "workers": [{"id": 0}],
        "sessions": [{"id": "s1"}],
        "vmu": {"devices": [{"worker": 0}]},
        "models": [{"name": "m"}],
    }
    app = DjinnTop("unix:///x", refresh=3600, source=FakeSource([sparse]))

    async def scenario(pilot: Pilot) -> None:
        await first_poll(pilot)
        workers = app.query_one("#workers", SortableTable)
        assert workers.cell_text("0", "alive") == "NO"
        assert workers.cell_text("0", "util") == "-"
        assert sessions_of(app).cell_text("s1", "bytes") == "-"
        assert app.query_one("#models", SortableTable).row_keys() == ["m"]

    run(app, scenario)


def test_watermark_bar_marks_used_and_peak_within_capacity():
    bar = render_watermark("w0 data", used=25, peak=75, capacity=100, width=100).plain
    cells = bar[16 : bar.index(" ", 16)]
    # The marker sits in the cell holding the peak byte.
    assert cells.index(PEAK) == math.ceil(0.75 * len(cells)) - 1
    assert cells.count(FULL) == round(0.25 * len(cells))
    assert "25%" in bar
    empty = render_watermark("w0 text", used=0, peak=0, capacity=0, width=100).plain
    assert PEAK not in empty and FULL not in empty and EMPTY in empty and "n/a" in empty


def test_rate_is_the_count_difference_over_the_appliance_uptime_difference():
    tracker = RateTracker()
    assert tracker.update(FIRST, {TOTAL: 100}) == {}  # one sample: no rate yet
    assert tracker.update(SECOND, {TOTAL: 150}) == {TOTAL: 25.0}  # 50 requests in 2 s
    restarted = copy.deepcopy(SECOND)
    restarted["appliance"]["pid"] += 1
    restarted["appliance"]["uptime_s"] += 10
    assert tracker.update(restarted, {TOTAL: 3}) == {}  # a new appliance: new baseline


def test_worker_rows_show_the_utilisation_the_workers_report():
    """issue 16 §7: from the document, whatever host `djinn top` runs on; a CPU worker's
    figure is its process's CPU share and says so."""
    from djinn.tui.widgets.rows import worker_rows

    doc = {
        "workers": [
            {"id": 0, "alive": True, "utilisation": 41, "utilisation_source": "nvml"},
            {"id": 1, "alive": True, "utilisation": 73.4, "utilisation_source": "process_cpu"},
            {"id": 2, "alive": True, "utilisation": None, "utilisation_source": "process_cpu"},
            {"id": 3, "alive": True, "busy": {"session": "a", "kind": "EXEC", "for_s": 7.2}},
        ]
    }
    rows = worker_rows(doc)
    assert [rows[k][-1].plain for k in "012"] == ["41%", "73% cpu", "-"]
    assert rows["3"][3].plain == "busy 7s"


def test_request_latency_is_labelled_with_the_appliances_window():
    """issue 16 §8: percentiles cover the last stats_window seconds, and top says so."""
    windowed = copy.deepcopy(FIRST)
    windowed["appliance"]["stats_window_s"] = 60.0
    app = DjinnTop("unix:///x", refresh=3600, source=FakeSource([windowed]))

    async def scenario(pilot: Pilot) -> None:
        await first_poll(pilot)
        title = str(app.query_one("#requests", SortableTable).border_title)
        assert title.startswith("Requests (latency: last 60s): ")

    run(app, scenario)
