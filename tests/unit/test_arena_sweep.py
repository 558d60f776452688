"""Start-up sweep: segments of dead supervisors go, live ones stay."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import posix_ipc

from djinn.appliance.vmu.arena import boot_id, sweep_stale


def _segment(name: str) -> None:
    posix_ipc.SharedMemory(name, flags=posix_ipc.O_CREX, size=4096).close_fd()


def test_sweep_removes_dead_owners_and_keeps_live_ones():
    dead = f"/djinn-{boot_id()}-4000001-arena"  # above pid_max: never alive
    other_boot = f"/djinn-0badb007-{os.getpid()}-arena"
    live = f"/djinn-{boot_id()}-{os.getpid()}-arena"  # this test process runs "djinn" code
    for name in (dead, other_boot, live):
        _segment(name)
    try:
        sweep_stale()
        assert not Path("/dev/shm", dead[1:]).exists()
        assert not Path("/dev/shm", other_boot[1:]).exists()
        cmdline = Path(f"/proc/{os.getpid()}/cmdline").read_bytes()
        assert Path("/dev/shm", live[1:]).exists() == (b"djinn" in cmdline)
    finally:
        for name in (dead, other_boot, live):
            with contextlib.suppress(posix_ipc.ExistentialError):
                posix_ipc.unlink_shared_memory(name)
