"""Device VMU accounting: one budget per device, seen through text / data / stack views.

- text:  weights shared between sessions (filled by the model path);
- data:  values sessions keep between calls (handles, KV caches);
- stack: activations alive while a request executes.

Note [one device budget] (issue 9): the segments are accounting views over *one* budget
(GPU memory, or ``cpu_worker_memory`` on a CPU worker), not fixed fractions of it, so a
big model may use what session data does not and the other way round. A segment may be
given a cap (``vmu_text_fraction`` / ``vmu_data_fraction``; 0 = none). ``reserve`` is
called *before* a tensor is created: when the budget is full it first asks the memory
manager to make room (``reclaim``: swap idle weights or KV caches to the host tier), and
only if that cannot free enough is the request refused with RESOURCE_EXHAUSTED, so the
device is never driven into an allocator OOM.
"""

from __future__ import annotations

from collections.abc import Callable

from djinn.errors import ResourceExhausted

SEGMENTS = ("text", "data", "stack")


class DeviceShort(ResourceExhausted):
    """Device memory is short even after eviction; what is left cannot move now, but may
    be freed soon (such a request may wait: Note [admission queue], admission.py)."""

    def __init__(self, message: str, short: int) -> None:
        super().__init__(message)
        self.short = short


_WHAT = {"text": "weights", "data": "session data", "stack": "activations"}


class Segment:
    """What one kind of bytes holds of its device's budget."""

    def __init__(self, vmu: DeviceVMU, name: str, cap: int = 0) -> None:
        self.vmu = vmu
        self.name = name
        self.cap = cap  # 0: bounded by the device budget alone
        self.used = 0
        self.peak = 0

    @property
    def capacity(self) -> int:
        return min(self.cap, self.vmu.capacity) if self.cap else self.vmu.capacity

    def reserve(self, nbytes: int) -> None:
        self.vmu.charge(self, nbytes)

    def release(self, nbytes: int) -> None:
        self.used = max(0, self.used - nbytes)

    def grow(self, nbytes: int) -> None:
        """Account bytes already allocated (a storage that grew while an op ran): the
        accounting follows the memory actually held, even past the budget."""
        self.used = max(0, self.used + nbytes)
        self.peak = max(self.peak, self.used)
        self.vmu.note_peak()

    def stats(self) -> dict[str, int]:
        return {"capacity": self.capacity, "used": self.used, "peak": self.peak}


class DeviceVMU:
    def __init__(self, capacity: int, text_cap: float = 0.0, data_cap: float = 0.0) -> None:
        if not (0 <= text_cap <= 1 and 0 <= data_cap <= 1):
            raise ValueError("vmu caps are fractions between 0 and 1")
        self.capacity = capacity
        caps = {"text": int(capacity * text_cap), "data": int(capacity * data_cap), "stack": 0}
        self.segments = {name: Segment(self, name, caps[name]) for name in SEGMENTS}
        self._views = tuple(self.segments.values())  # `used` runs for every op: no dict walk
        self.peak = 0
        # set by the memory manager: frees at least n bytes of the budget if it can
        self.reclaim: Callable[[int], int] | None = None

    def __getitem__(self, name: str) -> Segment:
        return self.segments[name]

    @property
    def used(self) -> int:
        text, data, stack = self._views
        return text.used + data.used + stack.used

    def free(self) -> int:
        return max(0, self.capacity - self.used)

    def make_room(self, nbytes: int) -> int:
        """Free bytes of the budget once eviction tried to bring them to ``nbytes``."""
        short = self.used + nbytes - self.capacity
        if short > 0 and self.reclaim is not None:
            self.reclaim(short)
        return self.free()

    def note_peak(self) -> None:
        self.peak = max(self.peak, self.used)

    def charge(self, seg: Segment, nbytes: int) -> None:
        if nbytes <= 0:
            return
        if seg.cap and seg.used + nbytes > seg.capacity:
            raise ResourceExhausted(
                f"{_WHAT[seg.name]} ({seg.name}) are capped at {seg.capacity} bytes of this "
                f"device: {nbytes} bytes requested, {seg.capacity - seg.used} free "
                f"(vmu_{seg.name}_fraction)"
            )
        if nbytes > self.capacity:
            raise ResourceExhausted(
                f"{_WHAT[seg.name]}: {nbytes} bytes requested, {nbytes - self.capacity} more "
                f"than this device's whole memory ({self.capacity} bytes)"
            )
        self.make_room(nbytes)
        short = self.used + nbytes - self.capacity
        if short > 0:
            # what holds it, by kind: a session told to free its handles while the
            # memory was another session's model, in use by its call, had no way to
            # tell (a review)
            held = ", ".join(f"{_WHAT[s.name]} {s.used}" for s in self._views if s.used)
            raise DeviceShort(
                f"device memory full: {nbytes} bytes requested for {_WHAT[seg.name]}, "
                f"{short} bytes short of {self.capacity} after eviction (in use: {held}; "
                "what cannot move: session handles, activations, and the weights of "
                "models other calls are running); free handles or KV caches",
                short,
            )
        seg.used += nbytes
        seg.peak = max(seg.peak, seg.used)
        self.note_peak()

    def stats(self) -> dict[str, object]:
        return {
            "capacity": self.capacity,
            "used": self.used,
            "peak": self.peak,
            **{name: seg.stats() for name, seg in self.segments.items()},
        }
