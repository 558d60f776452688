"""`djinn top` against a real `djinn serve`: tables fill, sessions come and go, ending a
session from the TUI frees it, and the dashboard survives an appliance restart."""

from __future__ import annotations

import asyncio
import re

import pytest
import torch
from textual.pilot import Pilot

from djinn.cli.status import human_bytes
from djinn.errors import DjinnError
from djinn.tui.app import DjinnTop
from djinn.tui.widgets.confirm import ConfirmScreen
from djinn.tui.widgets.table import SortableTable
from djinn.tui.widgets.watermark import WatermarkBar

from .conftest import connected, run, until

REFRESH = 0.2


def table(app: DjinnTop, name: str) -> SortableTable:
    return app.query_one(f"#{name}", SortableTable)


@pytest.mark.timeout(60)
def test_tables_fill_with_one_row_per_worker_and_the_arena_capacity(appliance):
    doc = appliance.stats()
    app = DjinnTop(appliance.unix, refresh=REFRESH)

    async def scenario(pilot: Pilot) -> None:
        await until(pilot, lambda: app.polls >= 1 and connected(app))
        workers = table(app, "workers")
        assert sorted(workers.row_keys()) == sorted(str(w["id"]) for w in doc["workers"])
        for w in doc["workers"]:
            assert workers.cell_text(str(w["id"]), "pid") == str(w["pid"])
            # CPU workers report their process's CPU share, labelled (issue 16 §7);
            # "-" only until their first second of samples
            util = workers.cell_text(str(w["id"]), "util")
            assert util == "-" or re.fullmatch(r"\d+% cpu", util), util
        arena = app.query_one("#bar-host", WatermarkBar)
        capacity = doc["vmu"]["host_arena"]["capacity"]
        assert arena.capacity == capacity
        assert human_bytes(capacity) in str(arena.render())
        # text / data / stack for every device worker, under the arena.
        assert len(app.query(WatermarkBar)) == 1 + 3 * len(doc["vmu"]["devices"])
        assert f"pid {doc['appliance']['pid']}" in app.status_text

    run(app, scenario)


@pytest.mark.timeout(60)
def test_a_new_session_appears_within_one_refresh(appliance):
    app = DjinnTop(appliance.unix, refresh=REFRESH)
    client = appliance.connect()

    async def scenario(pilot: Pilot) -> None:
        await until(pilot, lambda: app.polls >= 1)
        with client.session() as session:
            session.put(torch.arange(1000, dtype=torch.float32))
            sessions = table(app, "sessions")
            await until(pilot, lambda: session.id in sessions.row_keys(), timeout=5)
            # Workers push stats at most every 0.1 s: the put may land a refresh later.
            await until(
                pilot,
                lambda: (
                    sessions.cell_text(session.id, "handles") == "1"
                    and sessions.cell_text(session.id, "bytes") == human_bytes(4000)
                ),
                timeout=5,
            )
        await until(pilot, lambda: session.id not in sessions.row_keys(), timeout=5)

    try:
        run(app, scenario)
    finally:
        client.close()


@pytest.mark.timeout(60)
def test_ending_a_session_from_the_tui_frees_it(appliance):
    app = DjinnTop(appliance.unix, refresh=REFRESH)
    client = appliance.connect()
    session = client.session()
    session.put(torch.ones(16))

    async def scenario(pilot: Pilot) -> None:
        sessions = table(app, "sessions")
        await until(pilot, lambda: session.id in sessions.row_keys())
        sessions.focus()
        sessions.move_cursor(row=sessions.get_row_index(session.id))
        assert sessions.selected_key == session.id
        await pilot.press("k")
        await until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press("y")
        await until(pilot, lambda: session.id not in sessions.row_keys(), timeout=5)

    try:
        run(app, scenario)
        ids = [s["id"] for s in appliance.stats()["sessions"]]
        assert session.id not in ids
        with pytest.raises(DjinnError):
            session.put(torch.ones(4))
    finally:
        session.close()
        client.close()


@pytest.mark.timeout(90)
def test_answering_no_keeps_the_session(appliance):
    app = DjinnTop(appliance.unix, refresh=REFRESH)
    client = appliance.connect()

    async def scenario(pilot: Pilot) -> None:
        with client.session() as session:
            sessions = table(app, "sessions")
            await until(pilot, lambda: session.id in sessions.row_keys())
            sessions.move_cursor(row=sessions.get_row_index(session.id))
            await pilot.press("k")
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
            await pilot.press("n")
            await until(pilot, lambda: not isinstance(app.screen, ConfirmScreen))
            polls = app.polls
            await until(pilot, lambda: app.polls >= polls + 2)
            assert session.id in sessions.row_keys()
            session.put(torch.ones(4))  # still alive

    try:
        run(app, scenario)
    finally:
        client.close()


@pytest.mark.timeout(120)
def test_an_appliance_restart_shows_disconnected_then_recovers(fresh_appliance):
    old = fresh_appliance(tcp_enabled=False)
    old_pid = old.stats()["workers"][0]["pid"]
    app = DjinnTop(old.unix, refresh=REFRESH)

    async def scenario(pilot: Pilot) -> None:
        workers = table(app, "workers")
        await until(pilot, lambda: connected(app) and workers.row_count)
        assert workers.cell_text("0", "pid") == str(old_pid)
        await asyncio.to_thread(old.stop)
        await until(pilot, lambda: "disconnected" in app.status_text, timeout=10)
        assert app.screen_stack[0].has_class("-stale")  # last numbers kept, shown as old
        new = await asyncio.to_thread(
            fresh_appliance, socket_path=old.socket_path, tcp_enabled=False
        )
        new_pid = (await asyncio.to_thread(new.stats))["workers"][0]["pid"]
        assert new_pid != old_pid
        await until(pilot, lambda: workers.cell_text("0", "pid") == str(new_pid), timeout=10)
        assert connected(app)
        assert not app.screen_stack[0].has_class("-stale")

    run(app, scenario)
