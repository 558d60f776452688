"""Mapping the host arena: the POSIX shared-memory segment that carries tensor bytes.

The supervisor creates the segment (``djinn.appliance.vmu.arena``); workers and
same-host clients map it by name. A slab is an (offset, length) range inside it; whoever
holds a lease on a slab reads and writes it in place, so a tensor crosses from a client
buffer to a worker with a single memcpy and no socket traffic for its bytes.
"""

from __future__ import annotations

import contextlib
import mmap

import posix_ipc


class ArenaMapping:
    """A process's view of the arena segment."""

    def __init__(self, name: str, size: int) -> None:
        shm = posix_ipc.SharedMemory(name, flags=0)
        try:
            if shm.size < size:
                raise ValueError(f"arena {name} is {shm.size} bytes, expected {size}")
            self._mmap = mmap.mmap(shm.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            shm.close_fd()
        self.name = name
        self.size = size
        self.view = memoryview(self._mmap)

    def slab(self, offset: int, length: int) -> memoryview:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise ValueError(f"slab [{offset}, +{length}) outside the arena of {self.size} bytes")
        return self.view[offset : offset + length]

    def address(self) -> int:
        """Base address of the mapping (for cudaHostRegister)."""
        import ctypes

        return ctypes.addressof(ctypes.c_char.from_buffer(self._mmap))

    def close(self) -> None:
        self.view.release()
        # Tensors may still view the mapping; then the OS unmaps it when the process exits.
        with contextlib.suppress(BufferError):
            self._mmap.close()
