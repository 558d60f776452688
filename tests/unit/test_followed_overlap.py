"""Note [steps followed while the graph runs] (djinn/frontend/replay_followed.py): which
sessions send a followed replay's split replay before following its steps."""

from __future__ import annotations

import os
import types

import pytest

from djinn.frontend.replay_followed import overlapped

CORES = len(os.sched_getaffinity(0))  # what the rule counts: the cores this process may use


@pytest.mark.parametrize(
    ("device", "threads", "want"),
    [
        ("cuda:0 (NVIDIA H200)", None, True),  # the kernels are not on the host's cores
        ("cpu:0", CORES, False),  # the worker's threads take every core: whole after
        ("cpu:0", CORES + 3, False),
        ("cpu:0", CORES - 1, CORES > 1),  # a core to spare for the client
        ("cpu:0", None, False),  # an appliance that does not say: as before
        ("", None, False),  # a fleet session not placed yet
    ],
)
def test_a_session_overlaps_where_its_worker_leaves_the_client_a_core(device, threads, want):
    session = types.SimpleNamespace(device=device, cpu_threads=threads)
    assert overlapped(session) is want
    session.client = types.SimpleNamespace(follow_ahead="auto")
    assert overlapped(session) is want


@pytest.mark.parametrize(("setting", "want"), [("always", True), ("never", False)])
def test_the_follow_ahead_setting_decides_for_every_worker(setting, want):
    client = types.SimpleNamespace(follow_ahead=setting)
    for device, threads in [("cuda:0", None), ("cpu:0", CORES), ("cpu:0", 1), ("", None)]:
        session = types.SimpleNamespace(device=device, cpu_threads=threads, client=client)
        assert overlapped(session) is want
