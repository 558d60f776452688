"""`djinn top`: a live dashboard of one appliance, built only from its stats document.

Every `refresh` seconds a poll runs off the UI thread (so a slow or dead appliance never
freezes the screen); its document then updates every panel in place. When the appliance
cannot be reached the status line says "disconnected", the panels keep their last values
(dimmed), and polling goes on until it answers again. A poll that gets no answer at all
(a frozen appliance) is reported as "not responding" while it waits.
"""

from __future__ import annotations

import time
from typing import Any

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.widgets import Footer, Static

from djinn.errors import DjinnError

from .source import Source, StatsSource, off_thread
from .widgets.confirm import ConfirmScreen
from .widgets.requests import REQUEST_COLUMNS, RateTracker, by_worker, request_rows, summary
from .widgets.requests import totals as request_totals
from .widgets.rows import (
    MODEL_COLUMNS,
    SESSION_COLUMNS,
    WORKER_COLUMNS,
    fmt_duration,
    model_rows,
    segments,
    session_rows,
    worker_rows,
)
from .widgets.table import SortableTable
from .widgets.watermark import WatermarkBar

STALL_S = 3.0  # a poll unanswered this long (and 3 refreshes) is "not responding"


def _bar_id(key: str) -> str:
    # Widget ids allow letters, digits, '-' and '_'; worker ids could one day be anything.
    return "bar-" + "".join(c if c.isalnum() or c in "-_" else "_" for c in key)


class DjinnTop(App[None]):
    CSS_PATH = "top.tcss"
    TITLE = "djinn top"
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("k", "kill", "End session"),
        Binding("r", "poll", "Refresh"),
    ]

    def __init__(
        self,
        address: str,
        token: str | None = None,
        refresh: float = 1.0,
        source: Source | None = None,
    ) -> None:
        super().__init__()
        self.address = address
        self.refresh_s = refresh
        self.source: Source = source if source is not None else StatsSource(address, token)
        self.polls = 0  # completed polls, so tests can wait for "one more refresh"
        self.doc: dict[str, Any] | None = None  # last document received, if any
        self.stall_s = max(STALL_S, 3 * refresh)
        self._polling_since: float | None = None  # monotonic start of the poll in flight
        self._rates = RateTracker()

    def compose(self) -> ComposeResult:
        yield Static(id="status")
        with Horizontal(id="top-row"):
            yield SortableTable(WORKER_COLUMNS, title="Workers", id="workers")
            yield SortableTable(REQUEST_COLUMNS, title="Requests", id="requests")
        memory = Vertical(id="memory")
        memory.border_title = "Memory: used █, peak ┃, capacity = the whole bar"
        yield memory
        yield SortableTable(SESSION_COLUMNS, title="Sessions", id="sessions")
        yield SortableTable(MODEL_COLUMNS, title="Models", id="models")
        yield Footer()

    def on_mount(self) -> None:
        self._show_status()
        self._dashboard.query_one("#sessions", SortableTable).focus()
        self.set_interval(self.refresh_s, self.action_poll)
        self.action_poll()

    # -- polling -------------------------------------------------------------------------

    def action_poll(self) -> None:
        if self._polling_since is not None:
            self._show_status()  # still waiting: maybe time to say "not responding"
            return
        self.run_worker(self.poll_once(), group="poll")

    async def poll_once(self) -> None:
        """Fetch one document (off the UI thread) and show it; skipped while one is
        already in flight, so a hung appliance cannot pile up blocked threads."""
        if self._polling_since is not None:
            return
        self._polling_since = time.monotonic()
        try:
            doc = await off_thread(self.source.poll)
        finally:
            self._polling_since = None
        if not self.screen_stack:  # the app closed while the poll was in flight
            return
        try:
            if doc is not None:
                self.doc = doc
                self._show(doc)
            self._show_status()
        except NoMatches:  # the app is closing: its panels are already gone
            return
        # On the dashboard's own screen, not `self.screen` (that may be the kill dialog).
        self.screen_stack[0].set_class(doc is None and self.doc is not None, "-stale")
        self.polls += 1

    @property
    def _dashboard(self) -> Any:
        """The dashboard's own screen: a refresh while the kill dialog is open must find
        its panels there, not on the dialog (`self.query_one` looks at the active one)."""
        return self.screen_stack[0]

    @property
    def status_text(self) -> str:
        """The status line as plain text ("... connected ..." / "... disconnected ...")."""
        return str(self._dashboard.query_one("#status", Static).content)

    def _show_status(self) -> None:
        line = Text(f" djinn top  {self.address}  ")
        waited = 0.0 if self._polling_since is None else time.monotonic() - self._polling_since
        if waited > self.stall_s:
            line.append("◌ not responding", style="bold yellow")
            line.append(f"  no answer to a stats request for {waited:.0f}s")
        elif self.source.connected and self.doc is not None:
            line.append("● connected", style="bold green")
            app = self.doc.get("appliance", {})
            line.append(
                f"  appliance pid {app.get('pid', '?')}  up {fmt_duration(app.get('uptime_s'))}"
                f"  protocol {app.get('protocol', '?')}"
            )
        elif self.polls or self.source.error:
            line.append("○ disconnected", style="bold red")
            line.append(f"  {self.source.error}  (retrying every {self.refresh_s:g}s)")
        else:
            line.append("… connecting", style="yellow")
        self._dashboard.query_one("#status", Static).update(line)

    def _show(self, doc: dict[str, Any]) -> None:
        self._dashboard.query_one("#workers", SortableTable).set_rows(worker_rows(doc))
        groups = by_worker(doc)
        rates = self._rates.update(doc, request_totals(groups))
        requests = self._dashboard.query_one("#requests", SortableTable)
        requests.set_rows(request_rows(groups, rates))
        window = doc.get("appliance", {}).get("stats_window_s")
        label = f"Requests (latency: last {window:g}s)" if window else "Requests"
        requests.border_title = f"{label}: {summary(groups, rates)}"
        self._show_memory(doc)
        self._dashboard.query_one("#sessions", SortableTable).set_rows(session_rows(doc))
        self._dashboard.query_one("#models", SortableTable).set_rows(model_rows(doc))

    def _show_memory(self, doc: dict[str, Any]) -> None:
        memory = self._dashboard.query_one("#memory", Vertical)
        segs = segments(doc)
        bars = list(memory.query(WatermarkBar))
        if [b.id for b in bars] != [_bar_id(key) for key, _, _ in segs]:
            # Workers came or went: rebuild the bars in document order (rare).
            memory.remove_children()
            bars = [WatermarkBar(label, id=_bar_id(key)) for key, label, _ in segs]
            memory.mount_all(bars)
        for bar, (_, _, seg) in zip(bars, segs, strict=True):
            bar.update_values(
                int(seg.get("used", 0)), int(seg.get("peak", 0)), int(seg.get("capacity", 0))
            )

    # -- ending a session ----------------------------------------------------------------

    def action_kill(self) -> None:
        session = self._dashboard.query_one("#sessions", SortableTable).selected_key
        if session is None:
            self.notify("No session selected.", severity="warning")
            return

        def answered(yes: bool | None) -> None:
            if yes:
                self.run_worker(self._kill(session), group="kill")

        self.push_screen(
            ConfirmScreen(f"End session {session}? Its handles and memory are freed now."),
            answered,
        )

    async def _kill(self, session: str) -> None:
        try:
            killed = await off_thread(self.source.kill_session, session)
        except (DjinnError, OSError) as exc:
            self.notify(f"Could not end session {session}: {exc}", severity="error")
            return
        if killed:
            self.notify(f"Ended session {session}.")
        else:
            self.notify(f"Session {session} was already gone.", severity="warning")
        await self.poll_once()

    async def action_quit(self) -> None:
        await off_thread(self.source.close)
        self.exit()


def run_top(address: str, token: str | None = None, refresh: float = 1.0) -> None:
    """Entry point of `djinn top`."""
    DjinnTop(address, token=token, refresh=refresh).run()
