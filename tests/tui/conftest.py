"""Helpers for the `djinn top` tests: a pilot runner, a polling wait, a fake source."""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Awaitable, Callable
from typing import Any

from textual.pilot import Pilot

from djinn.tui.app import DjinnTop

SIZE = (140, 44)


def run(app: DjinnTop, scenario: Callable[[Pilot], Awaitable[None]]) -> None:
    """Drive `app` headless with a pilot (sync wrapper: no async test plugin needed)."""

    async def main() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await scenario(pilot)

    asyncio.run(main())


async def until(pilot: Pilot, predicate: Callable[[], Any], timeout: float = 10.0) -> Any:
    """Let the app run until predicate() is truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        await pilot.pause(0.05)


def connected(app: DjinnTop) -> bool:
    return "● connected" in app.status_text


class FakeSource:
    """Stands in for StatsSource: hands out canned documents in order, then the last one."""

    def __init__(self, docs: list[dict[str, Any]], address: str = "unix:///run/djinn.sock"):
        self.address = address
        self.error = ""
        self.killed: list[str] = []
        self._docs = [copy.deepcopy(d) for d in docs]
        self._polls = 0

    @property
    def connected(self) -> bool:
        return True

    def poll(self) -> dict[str, Any] | None:
        doc = self._docs[min(self._polls, len(self._docs) - 1)]
        self._polls += 1
        return copy.deepcopy(doc)

    def kill_session(self, session_id: str) -> bool:
        self.killed.append(session_id)
        return True

    def close(self) -> None:
        pass
