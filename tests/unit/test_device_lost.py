"""Note [a lost GPU context]: a worker whose CUDA context is lost (a device-side assert is
sticky) leaves after answering the failed request, so the supervisor starts a fresh one;
a CPU worker never does. Run with doubles: the CPU-only suite has no CUDA context to lose
(the GPU run that found it is in the stop-27 note)."""

from __future__ import annotations

import socket
import types

import pytest
import torch

from djinn.appliance import control, device_lost
from djinn.appliance.executor.device import CpuDevice, CudaDevice


def _cuda_device() -> CudaDevice:
    device = CudaDevice.__new__(CudaDevice)  # no CUDA here: the probe is what is tested
    device.index, device.torch_device, device.name = 0, torch.device("cuda", 0), "cuda:0"
    return device


def test_a_cuda_device_whose_synchronize_raises_is_lost(monkeypatch):
    device = _cuda_device()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: None)
    assert device.healthy()

    def sticky(d=None):
        raise RuntimeError("CUDA error: device-side assert triggered")

    monkeypatch.setattr(torch.cuda, "synchronize", sticky)
    assert not device.healthy()
    assert CpuDevice(0, 1 << 20).healthy()


class Outbox:
    """A reply queued on a slow reader: the first flush writes part of it."""

    def __init__(self) -> None:
        self.flushed = 0

    def __bool__(self) -> bool:
        return self.flushed < 2

    def flush(self, sock) -> bool:
        self.flushed += 1
        return self.flushed >= 2


def test_a_worker_with_a_lost_device_flushes_its_replies_and_exits(monkeypatch):
    exits: list[int] = []

    def fake_exit(code: int) -> None:
        exits.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(device_lost.os, "_exit", fake_exit)
    here, _there = socket.socketpair()
    session = types.SimpleNamespace(outbox=Outbox(), sock=here)
    worker = types.SimpleNamespace(
        id=0, device=types.SimpleNamespace(healthy=lambda: True, name="cuda:0"),
        sessions={"s1": session},
    )  # fmt: skip
    device_lost.exit_if_lost(worker)  # healthy: nothing happens
    assert exits == [] and session.outbox.flushed == 0
    worker.device.healthy = lambda: False
    with pytest.raises(SystemExit):
        device_lost.exit_if_lost(worker)
    assert exits == [control.DEVICE_LOST_EXIT]
    assert session.outbox.flushed == 2  # the culprit's error reply went out whole first


def test_a_gpu_workers_budget_is_its_setting_within_what_the_card_has_free(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (10 << 30, 80 << 30))
    device = _cuda_device()
    device._memory = "auto"
    assert device.capacity(1) == int((10 << 30) * 0.9)
    device._memory = 4 << 30
    assert device.capacity(1) == 4 << 30  # an operator sharing the card gives less
    device._memory = 64 << 30
    assert device.capacity(1) == int((10 << 30) * 0.9)  # cut to what is free, warned
