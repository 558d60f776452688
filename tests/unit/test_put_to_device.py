"""A PUT on a worker whose device does not adopt host memory (a GPU) moves every tensor
to the device: those that came through an arena slab and those sent inline in the frame.
The inline ones stayed in host memory on a GPU worker (seen on an H200), and the next op
mixing them with device tensors failed; this runs the handler with a device double, as
the CPU-only suite must."""

from __future__ import annotations

import types

import torch

from djinn.appliance.handlers import handle_put
from djinn.protocol.tensors import to_wire


class DeviceDouble:
    """A device that, like CudaDevice, copies what it is handed out of host memory."""

    adopts_host_memory = False

    def __init__(self) -> None:
        self.moved: list[torch.Tensor] = []

    def from_host(self, t: torch.Tensor) -> torch.Tensor:
        out = t.clone()
        self.moved.append(out)
        return out


def test_an_inline_put_reaches_the_device_like_a_slab_put():
    device = DeviceDouble()
    kept: list[torch.Tensor] = []
    store = types.SimpleNamespace(
        keep=lambda s, t, slab=None, host=False, name=None: kept.append(t) or f"h{len(kept)}",
        drop=lambda s, h: None,
    )
    w = types.SimpleNamespace(
        device=device, store=store, uploads=types.SimpleNamespace(uploading=lambda sid: False)
    )
    session = types.SimpleNamespace(id="s1", frame_slabs={}, via_unix=False)
    values = [torch.arange(6, dtype=torch.float32), torch.ones(2, 2, dtype=torch.int64)]
    entries, segments = [], []
    for k, t in enumerate(values):
        desc, flat = to_wire(t)
        entries.append({"desc": desc, "seg": k})
        segments.append(memoryview(flat.numpy().tobytes()))
    frame = types.SimpleNamespace(body={"tensors": entries}, segments=segments)
    reply, _ = handle_put(w, session, frame)
    assert reply["handles"] == ["h1", "h2"]
    assert [id(t) for t in kept] == [id(t) for t in device.moved]  # every one moved
    for want, got in zip(values, kept, strict=True):
        assert torch.equal(want, got)
