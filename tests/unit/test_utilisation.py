"""Workers measure their own device's utilisation (issue 16 §7)."""

from __future__ import annotations

import sys
import types

from djinn.appliance import utilisation
from djinn.appliance.utilisation import Utilisation


def test_a_cuda_worker_asks_nvml_for_its_own_index(monkeypatch):
    seen: list[int] = []

    def handle(index: int) -> int:
        seen.append(index)
        return index

    fake = types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlDeviceGetHandleByIndex=handle,
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=40 + h),
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    # a driver without the memory query still gives the utilisation
    assert Utilisation("cuda:1").sample() == {"percent": 41.0, "source": "nvml"}
    assert seen == [1]


def test_a_cuda_worker_reports_its_cards_memory_from_nvml(monkeypatch):
    from djinn.cli.status import render

    fake = types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda index: index,
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=7),
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=3 << 30, total=80 << 30),
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    sample = Utilisation("cuda:0").sample()
    assert sample == {
        "percent": 7.0,
        "source": "nvml",
        "memory_used": 3 << 30,
        "memory_total": 80 << 30,
    }
    worker = {"id": 0, "device": "cuda:0", "utilisation": 7.0, "utilisation_source": "nvml",
              "gpu_memory_used": 3 << 30, "gpu_memory_total": 80 << 30}  # fmt: skip
    assert "7% 3.0 GiB/80.0 GiB" in render({"workers": [worker]})
    from tui.widgets.rows import worker_rows

    assert worker_rows({"workers": [worker]})["0"][-1].plain == "7% 3.0 GiB/80.0 GiB"


def test_without_nvml_a_cuda_worker_says_unknown_and_stops_asking(monkeypatch):
    calls = []

    def broken() -> None:
        calls.append(1)
        raise RuntimeError("NVML Shared Library Not Found")

    monkeypatch.setitem(sys.modules, "pynvml", types.SimpleNamespace(nvmlInit=broken))
    util = Utilisation("cuda:0")
    for _ in range(3):
        assert util.sample() == {"percent": None, "source": "nvml (unavailable)"}
    assert calls == [1]


def test_a_cpu_worker_reports_its_process_cpu_share_labelled_as_such(monkeypatch):
    clock = {"wall": 100.0, "cpu": 10.0}
    monkeypatch.setattr(utilisation.time, "monotonic", lambda: clock["wall"])
    monkeypatch.setattr(utilisation, "_cpu_seconds", lambda: clock["cpu"])
    util = Utilisation("cpu:0")
    util._cores = 2
    assert util.sample() == {"percent": None, "source": "process_cpu"}  # nothing measured yet
    clock["wall"] += 2.0
    clock["cpu"] += 3.0  # 1.5 of 2 cores for 2 s
    assert util.sample() == {"percent": 75.0, "source": "process_cpu"}
    clock["wall"] += 0.1  # too short to measure again: the last figure stands
    assert util.sample()["percent"] == 75.0
