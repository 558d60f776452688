"""Note [appliance loss] (djinn/fleet/client.py): the error a fleet session raises once its
appliance is gone. A node's workers can die before its supervisor stops answering and
before the directory hears of it, so the first loss may be judged "a worker died"; the
appliance's loss learned later must still be raised as APPLIANCE_LOST (CI of stop 52 got
a plain SESSION_LOST there, in test_fleet's killed-node test)."""

from __future__ import annotations

import pytest

from djinn.errors import ApplianceLost, SessionLost, WorkerLost
from djinn.fleet.session import FleetSession


class _Fleet:
    """The directory's answers, one per question, as a killed node gives them."""

    def __init__(self, *verdicts: str | None) -> None:
        self.verdicts = list(verdicts)
        self.asked = 0

    def verdict(self, appliance: str, endpoint: str, why: str) -> str | None:
        self.asked += 1
        return self.verdicts.pop(0) if len(self.verdicts) > 1 else self.verdicts[0]


def _placed(fleet: _Fleet, recover: bool = False) -> FleetSession:
    s = FleetSession(fleet, recover=recover)  # type: ignore[arg-type]
    # as FleetClient._open leaves it, without a connection
    s.appliance, s.endpoint, s.id, s._lost = "app-7", "tcp://10.0.0.7:7001", "s1", None
    s._lineage = object() if recover else None  # type: ignore[assignment]
    return s


def test_a_worker_loss_later_found_to_be_the_appliances_raises_appliance_lost():
    fleet = _Fleet(None, "the fleet lost it: node 10.0.0.7 died")
    s = _placed(fleet)
    first = s._lost_error("Connection reset by peer")
    assert type(first) is WorkerLost  # the supervisor still answered then
    later = s._lost_error("connection already closed")
    assert isinstance(later, ApplianceLost) and isinstance(later, SessionLost)
    assert "app-7" in later.message and "node 10.0.0.7 died" in later.message
    again = s._lost_error("connection already closed")
    assert isinstance(again, ApplianceLost)
    assert fleet.asked == 2  # once known, the fleet is not asked again


def test_a_worker_loss_on_a_live_appliance_stays_session_lost():
    fleet = _Fleet(None)
    s = _placed(fleet)
    assert type(s._lost_error("reset")) is WorkerLost
    later = s._lost_error("connection already closed")
    assert type(later) is SessionLost and "reset" in later.message


def test_the_watchers_cut_after_a_worker_loss_makes_it_the_appliances():
    s = _placed(_Fleet(None))
    assert type(s._lost_error("reset")) is WorkerLost
    s._cut("the fleet lost it (the directory says app-7 is dead)")
    later = s._lost_error("connection already closed")
    assert isinstance(later, ApplianceLost) and "app-7 is dead" in later.message


@pytest.mark.parametrize("verdicts", [("dead",), (None, "dead")])
def test_a_recovering_session_gets_worker_lost_once_then_session_lost(verdicts):
    """Note [fleet recovery]: the journal recovers from the first WORKER_LOST."""
    s = _placed(_Fleet(*verdicts), recover=True)
    if verdicts[0] is None:
        assert type(s._lost_error("reset")) is WorkerLost  # a worker, as it looked then
    first = s._lost_error("connection already closed")
    assert type(first) is WorkerLost and "another appliance" in first.message
    assert type(s._lost_error("closed")) is SessionLost
