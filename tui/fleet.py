"""`djinn top --fleet`: every appliance of a fleet in one table, from the directory.

Deliberately small: one row per appliance (state, load, free memory, resident models)
and one per model (how many copies the fleet holds, where). The per-appliance dashboard
is `djinn top --address tcp://<endpoint>` for any row. Polls run off the UI thread, as
in `djinn top`; an unreachable directory dims nothing and says so in the status line.
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.widgets import Footer, Static

from djinn.fleet.render import APPLIANCE_HEADERS, appliance_row, model_copies

from .source import off_thread
from .widgets.table import Cell, Column, Rows, SortableTable

NUMERIC = {"sessions", "queued", "placed"}
APPLIANCE_COLUMNS = [Column(h, h, numeric=h in NUMERIC) for h in APPLIANCE_HEADERS]
MODEL_COLUMNS = [
    Column("model", "model"),
    Column("name", "name"),
    Column("copies", "copies", numeric=True),
    Column("appliances", "appliances"),
    Column("bytes", "bytes", numeric=True),
]


class FleetSource(Protocol):
    address: str
    error: str

    def poll(self) -> dict[str, Any] | None: ...

    def close(self) -> None: ...


class DirectorySource:
    """Reads the fleet document through a ``FleetClient`` (Ray), connecting lazily."""

    def __init__(self, address: str, token: str | None = None) -> None:
        self.address, self.token, self.error = address, token, ""
        self._client: Any = None

    def poll(self) -> dict[str, Any] | None:
        from djinn.errors import DjinnError

        try:
            if self._client is None:
                from djinn.fleet.client import FleetClient

                self._client = FleetClient(self.address, self.token)
            doc = self._client.stats()
        except (DjinnError, OSError, Exception) as exc:  # Ray raises its own kinds
            self.error = str(exc) or type(exc).__name__
            return None
        self.error = ""
        return doc

    def close(self) -> None:
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()


def appliance_rows(doc: dict[str, Any]) -> Rows:
    rows: Rows = {}
    for a in doc.get("appliances", []):
        texts = appliance_row(a)
        rows[a["id"]] = [
            Cell(t, int(t) if c.numeric and t.isdigit() else t, c.numeric)
            for t, c in zip(texts, APPLIANCE_COLUMNS, strict=True)
        ]
        rows[a["id"]][7] = Cell(texts[7], int(a.get("free_bytes", 0)), True)
        rows[a["id"]][8] = Cell(texts[8], int(a.get("capacity_bytes", 0)), True)
    return rows


def model_rows(doc: dict[str, Any]) -> Rows:
    from djinn.cli.status import human_bytes

    return {
        m["fingerprint"]: [
            Cell(m["fingerprint"]),
            Cell(m["name"] or "?"),
            Cell(str(len(m["appliances"])), len(m["appliances"]), True),
            Cell(" ".join(m["appliances"])),
            Cell(human_bytes(m["bytes"]), m["bytes"], True),
        ]
        for m in model_copies(doc)
    }


class FleetTop(App[None]):
    TITLE = "djinn top --fleet"
    BINDINGS = [Binding("q", "quit", "Quit"), Binding("r", "poll", "Refresh")]
    CSS = "SortableTable { height: auto; max-height: 60%; } #fleet-status { height: 2; }"

    def __init__(self, source: FleetSource, refresh: float = 1.0) -> None:
        super().__init__()
        self.source = source
        self.refresh_s = refresh
        self.polls = 0
        self.doc: dict[str, Any] | None = None

    def compose(self) -> ComposeResult:
        yield Static(id="fleet-status")
        yield SortableTable(APPLIANCE_COLUMNS, title="Appliances", id="appliances")
        yield SortableTable(MODEL_COLUMNS, title="Models", id="models")
        yield Footer()

    def on_mount(self) -> None:
        self.run_worker(self.poll_once(), exclusive=True)
        self.set_interval(self.refresh_s, self.action_poll)

    def action_poll(self) -> None:
        self.run_worker(self.poll_once(), exclusive=True, group="poll")

    async def poll_once(self) -> None:
        doc = await off_thread(self.source.poll)
        self.polls += 1
        if doc is not None:
            self.doc = doc
            self.query_one("#appliances", SortableTable).set_rows(appliance_rows(doc))
            self.query_one("#models", SortableTable).set_rows(model_rows(doc))
        self.query_one("#fleet-status", Static).update(self.status_text)

    @property
    def status_text(self) -> str:
        if self.doc is None or self.source.error:
            return f"{self.source.address}  ○ {self.source.error or 'connecting…'}"
        f = self.doc.get("fleet", {})
        return (
            f"{self.source.address}  ● {f.get('live', 0)}/{f.get('appliances', 0)} appliances "
            f"up · placement {f.get('placement', '?')} · {f.get('placements', 0)} placed"
        )

    async def action_quit(self) -> None:
        self.source.close()
        self.exit()


def run_fleet_top(address: str, token: str | None = None, refresh: float = 1.0) -> None:
    FleetTop(DirectorySource(address, token), refresh=refresh).run()
