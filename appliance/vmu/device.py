"""Device VMU accounting: a device's memory split into text, data and stack segments.

- text:  weights shared between sessions (filled by the model path);
- data:  values sessions keep between calls (handles, KV caches);
- stack: activations alive while a request executes.

Each segment has a capacity, the bytes in use and the peak. ``reserve`` is called
*before* a tensor is created so a request that would not fit fails with
RESOURCE_EXHAUSTED and the device is never driven into an allocator OOM.
"""

from __future__ import annotations

from dataclasses import dataclass

from djinn.errors import ResourceExhausted

SEGMENTS = ("text", "data", "stack")


@dataclass
class Segment:
    name: str
    capacity: int
    used: int = 0
    peak: int = 0

    def reserve(self, nbytes: int) -> None:
        if self.used + nbytes > self.capacity:
            raise ResourceExhausted(
                f"{self.name} segment full: {nbytes} bytes requested, "
                f"{self.capacity - self.used} of {self.capacity} free"
            )
        self.used += nbytes
        self.peak = max(self.peak, self.used)

    def release(self, nbytes: int) -> None:
        self.used = max(0, self.used - nbytes)

    def stats(self) -> dict[str, int]:
        return {"capacity": self.capacity, "used": self.used, "peak": self.peak}


class DeviceVMU:
    def __init__(self, capacity: int, text_fraction: float, data_fraction: float) -> None:
        if not (text_fraction >= 0 and data_fraction >= 0 and text_fraction + data_fraction < 1):
            raise ValueError("vmu fractions must be >= 0 and leave room for the stack")
        text = int(capacity * text_fraction)
        data = int(capacity * data_fraction)
        self.capacity = capacity
        sizes = dict(zip(SEGMENTS, (text, data, capacity - text - data), strict=True))
        self.segments = {name: Segment(name, size) for name, size in sizes.items()}

    def __getitem__(self, name: str) -> Segment:
        return self.segments[name]

    def stats(self) -> dict[str, dict[str, int]]:
        return {name: seg.stats() for name, seg in self.segments.items()}
