"""`djinn top --fleet`: the fleet table from the directory's document (a fake source: the
real directory is exercised in tests/integration/test_fleet.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from djinn.tui.fleet import FleetTop
from djinn.tui.widgets.table import SortableTable

from .conftest import SIZE, until

pytestmark = pytest.mark.timeout(30)

MODEL = {"fingerprint": "abcdef012345", "name": "GPT2LMHeadModel", "bytes": 500 << 20}


def appliance(id: str, state: str = "up", **kw: Any) -> dict[str, Any]:
    row = {
        "id": id,
        "node_id": id * 4,
        "node_ip": "10.0.0.1",
        "endpoint": f"tcp://10.0.0.1:{7700 + len(id)}",
        "state": state,
        "for_s": 3.0,
        "why": "node died (Ray reports it dead)" if state == "dead" else "",
        "report_age_s": 0.2,
        "placed": 4,
        "workers": 1,
        "workers_up": 1,
        "sessions": 2,
        "queued": 0,
        "free_bytes": 3 << 30,
        "capacity_bytes": 4 << 30,
        "models": [],
    }
    return {**row, **kw}


DOC = {
    "schema": 1,
    "fleet": {"placement": "semantic", "placements": 12, "appliances": 3, "live": 2},
    "appliances": [
        appliance("a1", models=[MODEL]),
        appliance("b2", models=[MODEL]),
        appliance("c3", state="dead"),
    ],
}


class FakeFleet:
    address = "fleet://head:6379"

    def __init__(self, doc: dict[str, Any] | None) -> None:
        self.doc, self.error = doc, "" if doc else "cannot reach the Ray cluster"

    def poll(self) -> dict[str, Any] | None:
        return self.doc

    def close(self) -> None:
        pass


def drive(app: FleetTop, scenario) -> None:
    async def main() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await scenario(pilot)

    asyncio.run(main())


def test_every_appliance_and_every_models_copies_are_shown():
    app = FleetTop(FakeFleet(DOC), refresh=3600)

    async def scenario(pilot) -> None:
        await until(pilot, lambda: app.polls >= 1)
        table = app.query_one("#appliances", SortableTable)
        assert table.row_keys() == ["a1", "b2", "c3"]
        assert table.cell_text("c3", "state").startswith("dead 3s (node died")
        assert table.cell_text("a1", "free") == "3.0 GiB"
        models = app.query_one("#models", SortableTable)
        assert models.cell_text("abcdef012345", "copies") == "2"
        assert models.cell_text("abcdef012345", "appliances") == "a1 b2"
        assert "2/3 appliances up" in app.status_text

    drive(app, scenario)


def test_an_unreachable_directory_is_said_in_the_status_line():
    app = FleetTop(FakeFleet(None), refresh=3600)

    async def scenario(pilot) -> None:
        await until(pilot, lambda: app.polls >= 1)
        assert "cannot reach the Ray cluster" in app.status_text
        assert app.query_one("#appliances", SortableTable).row_keys() == []

    drive(app, scenario)
