"""Note [frozen imports]: the worker freezes its import-time objects at start, and once
more after its background imports only if no client state exists yet."""

import gc

import pytest

from djinn.appliance.gc_freeze import FreezeImports


@pytest.fixture(autouse=True)
def _unfreeze():
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_the_first_freeze_moves_every_tracked_object_out_of_the_collectors_reach():
    FreezeImports().at_ready()
    assert gc.get_freeze_count() > 1000


def test_nothing_is_decided_while_the_background_import_is_pending_or_running():
    f = FreezeImports()
    for state in ("pending", "running"):
        f.after_prewarm(state, pristine=True)
        assert not f.decided
    assert gc.get_freeze_count() == 0


@pytest.mark.parametrize("state", ["done", "failed", "off"])
def test_a_pristine_worker_freezes_again_once_the_import_is_over(state):
    f = FreezeImports()
    f.after_prewarm(state, pristine=True)
    assert f.decided and gc.get_freeze_count() > 1000


def test_a_worker_that_already_served_a_client_never_freezes_its_objects():
    f = FreezeImports()
    client_state = [object() for _ in range(10)]  # would be frozen with everything else
    f.after_prewarm("done", pristine=False)
    assert f.decided and gc.get_freeze_count() == 0
    f.after_prewarm("done", pristine=True)  # decided once: never again
    assert gc.get_freeze_count() == 0
    del client_state
