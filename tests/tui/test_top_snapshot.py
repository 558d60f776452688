"""The dashboard's layout, pinned: a fixed document, a fixed terminal, no clock."""

from __future__ import annotations

from textual.pilot import Pilot

from djinn.tui.app import DjinnTop

from .conftest import SIZE, FakeSource
from .docs import FIRST, SECOND


async def _two_polls(pilot: Pilot) -> None:
    app = pilot.app
    assert isinstance(app, DjinnTop)
    while app.polls < 1:  # the poll started on mount
        await pilot.pause(0.01)
    await app.poll_once()  # a second document, so the request rates exist
    await pilot.pause()


def test_layout_snapshot(snap_compare):
    # A refresh of an hour: only the polls made above happen while the picture is taken.
    app = DjinnTop("unix:///run/djinn.sock", refresh=3600, source=FakeSource([FIRST, SECOND]))
    assert snap_compare(app, terminal_size=SIZE, run_before=_two_polls)
