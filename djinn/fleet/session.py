"""A fleet session: a ``Session`` placed by the fleet's directory at its first use.

Note [lazy placement], Note [appliance loss] and Note [fleet recovery] are in
``client.py``, beside the ``FleetClient`` that places and watches these sessions.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import TYPE_CHECKING, Any

from djinn.errors import (
    ApplianceLost,
    DjinnError,
    SessionEnded,
    SessionLost,
    Unavailable,
    WorkerLost,
)
from djinn.runtime.session import Session

if TYPE_CHECKING:
    from .client import FleetClient


class FleetSession(Session):
    """A session that opens on the appliance the directory chooses, at its first use
    (Note [lazy placement]): until then it holds no connection, and every attribute of
    an open ``Session`` is missing, so touching any of them places it."""

    def __init__(
        self,
        fleet: FleetClient,
        model: str | None = None,
        appliance: str | None = None,
        recover: bool = False,
    ) -> None:
        self._fleet = fleet
        self._fleet_recover = recover
        self._fleet_model = model  # what it was placed by: placed by it again after a loss
        self.pinned = appliance
        self._fleet_lock = threading.Lock()
        self._fleet_closed = False
        self._fleet_lost = False  # the appliance is gone (Note [appliance loss])
        self._fleet_reported = False  # its loss was raised once (Note [fleet recovery])
        self.appliance: str | None = None
        self.endpoint = ""
        self.place_s = 0.0  # the directory's decision, as this client waited for it
        self.open_s = 0.0  # decision, connection and SESSION_OPEN
        if model or appliance:
            self._place(model)

    def _place(self, model: str | None) -> None:
        with self._fleet_lock:
            if self.appliance is not None:
                return
            if self._fleet_closed:
                raise SessionEnded("this session was closed before it was used")
            self._fleet_model = self._fleet_model or model
            self._fleet._open(self, self._fleet_model)

    def __getattr__(self, name: str) -> Any:
        # Only attributes not found otherwise get here: before placement, those an open
        # Session sets in __init__. Dunders and our own never place (copy, pickle, repr).
        state = self.__dict__
        if name.startswith("__") or "_fleet" not in state or state.get("appliance") is not None:
            raise AttributeError(name)
        self._place(None)
        return object.__getattribute__(self, name)

    def register_model(self, body: dict[str, Any]) -> dict[str, Any]:
        self._place(body.get("fingerprint"))
        return super().register_model(body)

    @property
    def usable(self) -> bool:
        if self.appliance is None:
            return not self._fleet_closed
        return super().usable

    def close(self) -> None:
        with self._fleet_lock:
            self._fleet_closed = True
            if self.appliance is None:
                return
        super().close()

    def _lost_error(self, why: str) -> DjinnError:
        if self.appliance is None:  # while opening: the caller places elsewhere
            return Unavailable(
                f"cannot open a session at {self.endpoint or 'the appliance'}: {why}"
            )
        if not self._fleet_lost:
            # Asked at every loss until the fleet confirms it, not only the first: a node's
            # workers can die before its supervisor stops answering, and before the
            # directory hears of it, so a first "the appliance answers" (a worker died)
            # may turn into "the appliance is gone" a moment later. The watcher cannot
            # correct it: it skips sessions whose connection is already closed.
            verdict = self._fleet.verdict(self.appliance, self.endpoint, why)
            if verdict is None:  # the appliance answers: one of its workers died
                return super()._lost_error(why)
            self._lost, self._fleet_lost = verdict, True
        where = f"session {self.id} on appliance {self.appliance} ({self.endpoint}) is gone"
        if self._lineage is not None:  # Note [fleet recovery]: errors the journal recovers
            first, self._fleet_reported = not self._fleet_reported, True
            kind = WorkerLost if first else SessionLost
            return kind(f"{where}: {self._lost}; rebuilding it on another appliance")
        return ApplianceLost(
            f"{where}: {self._lost}. Its tensors and KV caches are lost (it was opened "
            "without recover=True); new sessions go to the fleet's live appliances."
        )

    def _reopen(self) -> None:
        """Note [fleet recovery]: the lineage journal rebuilds a recovering session after
        a loss by reopening it, then replaying what it held. A worker lost inside a live
        appliance: reopened there (its supervisor has others). A lost appliance: placed
        again by the directory, by the model it was first placed by, away from the lost
        one, and reopened there."""
        if not self._fleet_lost:
            verdict = self._fleet.verdict(self.appliance, self.endpoint, "rebuilding it")
            if verdict is None:
                super()._reopen()
                return
            self._lost, self._fleet_lost = verdict, True
        self._fleet.forget(self.appliance, self.endpoint)
        self._fleet_reported = False
        self._fleet._open(self, self._fleet_model, reopen=True)

    def _cut(self, why: str) -> None:
        """The watcher learned the appliance is gone: fail this session's calls now."""
        if not self._fleet_lost:  # a worker's loss seen first is the appliance's now
            self._lost, self._fleet_lost = why, True
        with contextlib.suppress(OSError, AttributeError):
            self.channel.sock.shutdown(socket.SHUT_RDWR)

    def __repr__(self) -> str:
        if self.appliance is None:
            return "FleetSession(not placed yet)"
        return f"FleetSession({self.id} on {self.appliance})"
