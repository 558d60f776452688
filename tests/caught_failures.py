"""Helpers for tests of work after a failure: a function whose failing op eager's
``try`` catches, and the count of a session's handles on the appliance."""

from __future__ import annotations

import contextlib
import gc
import time

import torch


def caught_index(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Values made before an index that fails (``idx`` out of range: eager raises at the
    index, Djinn when the graph runs), read after it: a tuple output among them."""
    t = x * 2
    m = torch.max(x.reshape(2, 2), dim=1)
    with contextlib.suppress(IndexError):
        x[idx]
    return t + m.values.sum() + m.indices.sum()


def session_handles(appliance, session) -> int:
    """The handles ``session`` holds on ``appliance``, once every graph in flight landed
    and what the program let go was freed (the stats document lags: poll it)."""
    from djinn.frontend import inflight

    inflight.land_all()
    gc.collect()
    session.memory_allocated()  # a request: what was let go is freed with the next one
    return next(r for r in appliance.stats()["sessions"] if r["id"] == session.id)["handles"]


def settled_handles(appliance, session, apart: float = 0.3) -> tuple[int]:
    """``session_handles`` once two readings ``apart`` seconds apart agree: a count to
    compare with later is not one the lagging stats document has not caught up with
    (a count taken too early failed a CI rehearsal). As a 1-tuple, for ``wait_for``."""
    from tests.conftest import wait_for

    def agreed() -> tuple[int] | None:
        first = session_handles(appliance, session)
        time.sleep(apart)
        return (first,) if session_handles(appliance, session) == first else None

    return wait_for(agreed, timeout=30)
