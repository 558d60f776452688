"""``torch.remote_accelerator``: the device module PyTorch asks about the remote device.

PyTorch looks a backend's module up (``torch.get_device_module``) whenever it needs more
than a kernel: ``torch.random.fork_rng`` and activation checkpointing save and restore its
RNG state, autocast asks which dtypes it supports, ``torch.accelerator`` and
``GradScaler`` query it. This module answers as a CUDA device would.

Note [remote rng]: on a CPU worker's session, random ops on the remote device draw from
the *local CPU generator* (Note [seeded ops] in ``seeded.py``): the client records its
state with each random op and the worker restores it, so remote values equal local eager
values under one seed. The device's RNG state is then the CPU generator's state. On a GPU
worker's session they draw from the device's own generator, as CUDA eager's do (Note [a
GPU worker's generator]): its state is that generator's, 16 bytes. Seeding the device
seeds its generator, and the CPU one only where that is the device's (``torch.manual_seed``
seeds the CPU one itself, then calls ``manual_seed_all``).

Memory figures are the appliance's accounting of this process's session (its handles
and remote objects in the VMU's data segment), read from the stats document.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

import torch

from djinn.errors import UnsupportedOp

_local = threading.local()
_peak = 0
_peak_lock = threading.Lock()


def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return True


# what torch.utils.checkpoint reads (not is_initialized()) before it saves the device's RNG
# state for the recomputation: without it, a checkpointed dropout on a GPU worker's session
# drew another mask in backward (Note [a GPU worker's generator])
_initialized = True


def _lazy_init() -> None:
    pass


def device_count() -> int:
    return 1


def current_device() -> int:
    return getattr(_local, "device", 0)


def set_device(device: Any) -> None:
    index = device.index if isinstance(device, torch.device) else device
    if index not in (None, 0):
        raise ValueError(f"remote_accelerator:{index} does not exist (one device)")
    _local.device = 0


def get_device_name(device: Any = None) -> str:
    return "Djinn remote_accelerator"


def get_device_capability(device: Any = None) -> tuple[int, int]:
    return (0, 0)


def synchronize(device: Any = None) -> None:
    """Run everything this thread captured so far (the remote twin of a stream sync)."""
    from .trace import current, flush

    flush(current())


# -- RNG: Note [remote rng] -----------------------------------------------------------------
def _on_device(start: bool = True) -> bool:
    """Whether random ops draw from the device's generator: a GPU worker's session. With
    ``start``, the session is opened if there is none: a ``fork_rng`` before the first
    remote op saved the CPU state, and its draws inside then went unrestored (a review).
    Seeding opens none (``torch.manual_seed`` at a script's top must not start one)."""
    from .session import current_device_type

    return current_device_type(start=start) not in (None, "cpu")


def get_rng_state(device: Any = None) -> torch.Tensor:
    from .seeded import DEVICE_GENERATOR

    return DEVICE_GENERATOR.state() if _on_device() else torch.get_rng_state()


def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state()]


def set_rng_state(new_state: torch.Tensor, device: Any = None) -> None:
    from .seeded import DEVICE_GENERATOR, DEVICE_STATE_BYTES

    if new_state.numel() == DEVICE_STATE_BYTES:  # the device generator's
        DEVICE_GENERATOR.set_state(new_state)
    else:
        torch.set_rng_state(new_state)


def set_rng_state_all(new_states: list[torch.Tensor]) -> None:
    set_rng_state(new_states[0])


def manual_seed(seed: int) -> None:
    """Seed the device's generator; and the CPU one, the device's on a CPU worker's session
    (or where none is open yet), as ``torch.cuda.manual_seed`` leaves the CPU's alone."""
    from .seeded import DEVICE_GENERATOR

    DEVICE_GENERATOR.manual_seed(seed)
    if not _on_device(start=False):
        torch.default_generator.manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    manual_seed(seed)


def seed() -> None:
    from .seeded import DEVICE_GENERATOR

    if _on_device(start=False):
        cuda_seed()
    else:
        DEVICE_GENERATOR.manual_seed(torch.default_generator.seed())


def seed_all() -> None:
    seed()


def cuda_manual_seed(seed: int) -> None:
    """``torch.cuda.manual_seed`` (and ``_all``) under ``djinn run``: the remote device's
    generator, which a GPU worker's session draws from, and never the CPU one. A CPU
    worker's session draws from the CPU generator (Note [remote rng]), as the same script
    does on a machine without CUDA, where PyTorch's own call changes nothing; seeding the
    device's generator changes nothing there either."""
    from .seeded import DEVICE_GENERATOR

    DEVICE_GENERATOR.manual_seed(seed)


def cuda_seed() -> None:
    """``torch.cuda.seed`` (and ``_all``) under ``djinn run``: a random seed for the remote
    device's generator alone (``cuda_manual_seed``)."""
    from .seeded import DEVICE_GENERATOR

    DEVICE_GENERATOR.manual_seed(int.from_bytes(os.urandom(8), "little"))


def initial_seed() -> int:
    from .seeded import DEVICE_GENERATOR

    return DEVICE_GENERATOR.seed if _on_device() else torch.default_generator.initial_seed()


# -- autocast --------------------------------------------------------------------------------
def _is_in_bad_fork() -> bool:
    return False  # no device state survives a fork: a child opens its own session


def get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.float16, torch.bfloat16]


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


# -- memory: the appliance's figures ---------------------------------------------------------
def _session_bytes() -> int:
    global _peak
    from .session import default_session

    used = default_session().memory_allocated()
    with _peak_lock:
        _peak = max(_peak, used)
    return used


def memory_allocated(device: Any = None) -> int:
    """Bytes this process's session holds on the appliance (tensors and KV caches)."""
    from .trace import current, flush

    flush(current())  # pending work allocates: count it as eager PyTorch would have
    return _session_bytes()


def max_memory_allocated(device: Any = None) -> int:
    memory_allocated(device)
    return _peak


def memory_reserved(device: Any = None) -> int:
    return memory_allocated(device)


def max_memory_reserved(device: Any = None) -> int:
    return max_memory_allocated(device)


def reset_peak_memory_stats(device: Any = None) -> None:
    global _peak
    with _peak_lock:
        _peak = 0


_STAT_METRICS = (
    "allocated_bytes", "active_bytes", "requested_bytes", "reserved_bytes",
    "inactive_split_bytes", "allocation", "active", "segment", "inactive_split",
)  # fmt: skip


def memory_stats(device: Any = None) -> dict[str, int]:
    """``torch.cuda.memory_stats``'s keys (``memory_summary()`` reads every one of them:
    under ``djinn run`` it raised KeyError, a review). The bytes this session holds are
    its allocated, active, requested and reserved bytes, current and peak, in the whole
    and in the large pool; the caching allocator's own counts, which the appliance does
    not keep per session, are 0."""
    used = memory_allocated(device)
    stats: dict[str, int] = {"num_alloc_retries": 0, "num_ooms": 0, "max_split_size": -1}
    stats.update(num_sync_all_streams=0, num_device_alloc=0, num_device_free=0)
    for metric in _STAT_METRICS:
        for pool in ("all", "large_pool", "small_pool"):
            for stat in ("current", "peak", "allocated", "freed"):
                stats[f"{metric}.{pool}.{stat}"] = 0
    for metric in ("oversize_allocations", "oversize_segments"):
        for stat in ("current", "peak", "allocated", "freed"):
            stats[f"{metric}.{stat}"] = 0
    for metric in ("allocated_bytes", "active_bytes", "requested_bytes", "reserved_bytes"):
        for pool in ("all", "large_pool"):
            stats[f"{metric}.{pool}.current"] = used
            stats[f"{metric}.{pool}.peak"] = _peak
    return stats


def mem_get_info(device: Any = None) -> tuple[int, int]:
    """(free, total) bytes of the worker's device memory, as the appliance accounts it."""
    from .session import default_session

    session = default_session()
    stats = session.client.stats()
    devices = stats.get("vmu", {}).get("devices", [])
    dev = next((d for d in devices if d.get("worker") == session.worker), None)
    if dev is None:
        return 0, 0
    segments = [v for v in dev.values() if isinstance(v, dict) and "capacity" in v]
    total = sum(s["capacity"] for s in segments)
    return total - sum(s["used"] for s in segments), total


def empty_cache() -> None:
    pass


# -- what CUDA scripts also touch: properties, device contexts, streams, events, NVTX --------
class _Properties:
    """What ``get_device_properties`` answers: the appliance's figures, CUDA's names."""

    def __init__(self) -> None:
        self.name = get_device_name()
        self.total_memory = mem_get_info()[1]
        self.major, self.minor = get_device_capability()
        self.multi_processor_count = 0
        self.is_integrated = False

    def __repr__(self) -> str:
        return f"_RemoteDeviceProperties(name={self.name!r}, total_memory={self.total_memory})"


def get_device_properties(device: Any = None) -> _Properties:
    return _Properties()


# Note [no storages on the remote device]: a remote tensor is a wrapper with no storage on
# the client, and the remote device has no allocator here. ``storage.to(remote)``,
# ``storage.cuda()`` under ``djinn run`` (what ``torch.load(f, map_location=lambda s,
# loc: s.cuda())`` calls) made one with ``torch.UntypedStorage(n, device=...)`` and
# killed the process (SIGSEGV, no traceback; a review). ``torch._utils._to``, which
# moves a storage, enters this device module's ``device`` first: that is refused, typed.
_STORAGE_MOVE = torch._utils._to.__code__


class device:  # named as torch.cuda.device
    """``with torch.cuda.device(0):`` — there is one remote device: nothing to switch."""

    def __init__(self, device: Any) -> None:
        if sys._getframe(1).f_code is _STORAGE_MOVE:
            # Note [no storages on the remote device]
            raise UnsupportedOp(
                "a storage cannot move to the remote device: the appliance holds tensors, "
                "not storages (the client has none to fill). Move tensors instead "
                "(tensor.to(device)); in torch.load, pass map_location='cuda' (under "
                "djinn run) or 'remote_accelerator:0' rather than a function moving "
                "storages (map_location=lambda s, loc: s.cuda())"
            )
        set_device(device)

    def __enter__(self) -> device:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class Stream:
    """The remote device runs a session's work in order: one stream. Synchronising it
    runs what this thread captured (as a CUDA stream sync completes queued kernels)."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.device = torch.device("remote_accelerator", 0)
        self.priority = priority

    def synchronize(self) -> None:
        synchronize()

    def wait_stream(self, stream: Any) -> None:
        pass  # one stream: everything is already ordered

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> Event:
        event = event or Event()
        event.record(self)
        return event

    def query(self) -> bool:
        synchronize()
        return True

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def current_stream(device: Any = None) -> Stream:
    return Stream()


def default_stream(device: Any = None) -> Stream:
    return Stream()


def stream(s: Any) -> Stream:
    return s if isinstance(s, Stream) else Stream()


class Event:
    """A timing event: ``record`` runs the work captured so far, then notes the time, so
    ``elapsed_time`` measures the work between two events as seen from the client."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, **kw: Any) -> None:
        self.enable_timing = enable_timing
        self._at: float | None = None

    def record(self, stream: Any = None) -> None:
        import time

        synchronize()
        self._at = time.perf_counter()

    def synchronize(self) -> None:
        synchronize()

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: Event) -> float:
        if self._at is None or end._at is None:
            raise RuntimeError("both events must be recorded before elapsed_time")
        return (end._at - self._at) * 1000.0


def nvtx_range_push(msg: str) -> int:
    return 0


def nvtx_range_pop() -> int:
    return 0


def nvtx_mark(msg: str) -> None:
    pass
