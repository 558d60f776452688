"""The settings table: one declarative list of every setting Djinn reads, in sections
(the order of ``docs/operations.md``). How they are read, and in what precedence:
``djinn.config``."""

from __future__ import annotations

from . import address, fleet, sessions, watching, workers
from .setting import Setting

SETTINGS: tuple[Setting, ...] = (
    *address.SETTINGS,
    *workers.SETTINGS,
    *sessions.SETTINGS,
    *fleet.SETTINGS,
    *watching.SETTINGS,
)

__all__ = ["SETTINGS", "Setting"]
