"""Creating, reserving, sweeping and removing the host-arena segment (supervisor side).

Names are ``/djinn-<boot>-<pid>-arena``: the boot id and the supervisor's pid say who
owns a segment, so a new supervisor can remove what a crashed predecessor left behind
without touching a live appliance's segment.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import posix_ipc

from djinn.errors import ResourceExhausted

log = logging.getLogger("djinn.appliance.arena")

PREFIX = "djinn-"
SHM_DIR = Path("/dev/shm")


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip().replace("-", "")[:8]
    except OSError:  # pragma: no cover - not Linux
        return "noboot00"


def segment_name(kind: str = "arena") -> str:
    return f"/{PREFIX}{boot_id()}-{os.getpid()}-{kind}"


def _owner_alive(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"djinn" in cmdline


def sweep_stale() -> list[str]:
    """Unlink segments whose supervisor is gone (other boot, or dead pid)."""
    removed = []
    current = boot_id()
    for path in SHM_DIR.glob(PREFIX + "*"):
        parts = path.name[len(PREFIX) :].split("-")
        if len(parts) < 3 or not parts[1].isdigit():
            continue
        if parts[0] == current and _owner_alive(int(parts[1])):
            continue
        try:
            posix_ipc.unlink_shared_memory("/" + path.name)
            removed.append(path.name)
        except posix_ipc.ExistentialError:
            pass
    if removed:
        log.warning(
            "removed %d shared-memory segment(s) left by a crashed appliance: %s",
            len(removed),
            ", ".join(removed),
        )
    return removed


class HostArenaSegment:
    """The segment itself. Pages are reserved at creation so a full /dev/shm fails here
    with RESOURCE_EXHAUSTED instead of killing a worker with SIGBUS on first touch."""

    def __init__(self, size: int) -> None:
        self.name = segment_name()
        self.size = size
        shm = posix_ipc.SharedMemory(self.name, flags=posix_ipc.O_CREX, mode=0o600, size=0)
        try:
            if size:
                os.ftruncate(shm.fd, size)
                os.posix_fallocate(shm.fd, 0, size)
        except OSError as exc:
            shm.close_fd()
            shm.unlink()
            raise ResourceExhausted(
                f"cannot reserve a {size >> 20} MiB host arena in /dev/shm ({exc.strerror}); "
                "lower arena_bytes or free shared memory"
            ) from None
        shm.close_fd()

    def unlink(self) -> None:
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory(self.name)
