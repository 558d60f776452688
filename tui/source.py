"""Where `djinn top` gets its numbers: the appliance's stats API, polled.

The TUI talks to the appliance only through `Client.stats()` and `Client.kill_session()`
(DESIGN.md §4); even device utilisation comes from the document, measured by each worker
on the appliance's host (appliance/utilisation.py), so it is right from any machine.
`StatsSource` owns one control connection, opened lazily; any transport or
protocol failure closes it and marks the source disconnected, and the next poll simply
tries to connect again, so the dashboard recovers by itself when an appliance comes back
at the same address. Calls block (socket I/O): the app runs them off the UI thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from djinn.errors import DjinnError
from djinn.runtime.client import Client

T = TypeVar("T")
CLOSE_WAIT_S = 0.5


async def off_thread(fn: Callable[..., T], *args: Any) -> T:
    """Await `fn(*args)` run on a fresh *daemon* thread.

    Not `asyncio.to_thread`: its executor threads are joined at interpreter exit, so a
    poll stuck on a frozen appliance (SIGSTOP, a hung supervisor: the very moments an
    operator opens `djinn top`) would stop `q` from ever returning to the shell.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    def target() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as exc:  # handed to the awaiting coroutine, not lost
            result, error = None, exc
        with contextlib.suppress(RuntimeError):  # the app (and its loop) already closed
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=target, name="djinn-top-poll", daemon=True).start()
    return await future


class Source(Protocol):
    """What `DjinnTop` needs; tests inject a fake with canned documents."""

    address: str
    error: str

    @property
    def connected(self) -> bool: ...

    def poll(self) -> dict[str, Any] | None:
        """The latest stats document, or None when the appliance cannot be reached."""

    def kill_session(self, session_id: str) -> bool:
        """End a session; True if it existed. Raises DjinnError / OSError on failure."""

    def close(self) -> None: ...


class StatsSource:
    """Polls `Client.stats()`; reconnects on the next poll after any failure."""

    def __init__(self, address: str, token: str | None = None) -> None:
        self.address = address
        self.token = token
        self.error = ""
        self._client: Client | None = None
        # poll() runs on a worker thread and kill_session() on another; one control
        # connection carries one request at a time, so they take turns.
        self._lock = threading.Lock()

    @property
    def connected(self) -> bool:
        return self._client is not None

    def _connect(self) -> Client:
        if self._client is None:
            self._client = Client(self.address, self.token)
            self.error = ""
        return self._client

    def _drop(self, exc: BaseException) -> None:
        self.error = str(exc) or type(exc).__name__
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()
        self._client = None

    def poll(self) -> dict[str, Any] | None:
        with self._lock:
            try:
                doc = self._connect().stats()
            except (DjinnError, OSError) as exc:
                self._drop(exc)
                return None
        return doc

    def kill_session(self, session_id: str) -> bool:
        with self._lock:
            try:
                return self._connect().kill_session(session_id)
            except (DjinnError, OSError) as exc:
                self._drop(exc)
                raise

    def close(self) -> None:
        # A poll stuck on a frozen appliance holds the lock: do not wait for it on exit.
        if self._lock.acquire(timeout=CLOSE_WAIT_S):
            try:
                if self._client is not None:
                    with contextlib.suppress(Exception):
                        self._client.close()
                    self._client = None
            finally:
                self._lock.release()
