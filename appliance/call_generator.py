"""The client's generator, lent to a model call that may sample (``generate()``).

Note [a sampled model call]: ``generate(do_sample=True)`` draws its tokens from the
default generator of the device it runs on, here the worker's. Run with the worker's own
generator, the tokens under ``torch.manual_seed`` were other than eager's and other at
every call under the same seed, and the client's generator did not move, so every later
random number was off too. So the client sends the generator state a local call would
draw from (Note [seeded ops], Note [a GPU worker's generator] in
djinn/frontend/seeded.py) with every ``generate()``: a CPU worker runs the call on the
client's CPU state, whose ``torch.multinomial`` then draws exactly eager's numbers, and a
GPU worker on the device generator's seed and offset. The state the call left goes back
in the reply, the client takes it, and the worker's own state is put back, so nothing of
one session's draws reaches another's. A call that does not sample leaves the state as it
was, as eager does. The state travels as a payload segment, so a journal that replays the
call (Note [lineage journal]) draws the same tokens again.
"""

from __future__ import annotations

import struct
from typing import Any

import torch

from djinn.errors import InvalidArgument

from .executor.graph import PHILOX_STATE_BYTES

CPU_STATE_BYTES = 5056  # torch.get_rng_state() of a CPU generator (MT19937 and caches)


class ClientGenerator:
    """A context that runs its body on the client's generator state ``raw`` and leaves
    the state the body ended in as ``left`` (bytes of the same kind), restoring the
    worker's own state on exit, whether the body raised or not."""

    def __init__(self, device: torch.device, raw: Any) -> None:
        if not isinstance(raw, (bytes, bytearray, memoryview)):
            raise InvalidArgument("the generator state must be a payload segment")
        want = CPU_STATE_BYTES if device.type == "cpu" else PHILOX_STATE_BYTES
        if len(raw) != want:
            raise InvalidArgument(
                f"a {device.type} worker takes a generator state of {want} bytes, not {len(raw)}"
            )
        self.device, self.raw, self.left = device, bytes(raw), b""
        self._saved: torch.Tensor | None = None
        if device.type != "cpu":
            self.seed, self.offset = struct.unpack("<QQ", self.raw)
            if self.offset % 4:  # CUDA's generator refuses it
                raise InvalidArgument(f"generator offset {self.offset} is not a multiple of 4")

    def _cuda(self) -> torch.Generator:
        return torch.cuda.default_generators[self.device.index or 0]

    def __enter__(self) -> ClientGenerator:
        if self.device.type == "cpu":
            self._saved = torch.get_rng_state()
            try:
                torch.set_rng_state(torch.frombuffer(bytearray(self.raw), dtype=torch.uint8))
            except RuntimeError as exc:
                raise InvalidArgument(f"bad generator state: {exc}") from None
        else:
            gen = self._cuda()
            self._saved = gen.get_state()
            gen.manual_seed(self.seed)
            gen.set_offset(self.offset)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cpu":
            self.left = torch.get_rng_state().numpy().tobytes()
            torch.set_rng_state(self._saved)
        else:
            gen = self._cuda()
            self.left = struct.pack("<QQ", self.seed, gen.get_offset())
            gen.set_state(self._saved)
