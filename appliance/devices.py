"""Device discovery for the supervisor, through NVML only.

The supervisor must never initialise CUDA (it forks and supervises; a CUDA context in it
would be inherited badly and pin memory on GPU 0), so it asks NVML how many GPUs there
are and leaves every CUDA call to the workers.
"""

from __future__ import annotations

import contextlib
import logging

log = logging.getLogger("djinn.appliance.devices")


def nvml_gpu_count() -> int:
    try:
        import pynvml
    except ImportError:
        return 0
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver, no GPU: the normal case on CPU hosts
        return 0
    try:
        return int(pynvml.nvmlDeviceGetCount())
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def worker_devices(gpus: str, cpu_workers: int) -> list[str]:
    """One device spec per worker: 'cuda:N' for each GPU used, else 'cpu:N'."""
    spec = str(gpus).strip().lower()
    if spec in ("none", "", "off"):
        indices: list[int] = []
    elif spec == "auto":
        indices = list(range(nvml_gpu_count()))
    else:
        indices = [int(x) for x in spec.split(",") if x.strip()]
    if indices:
        return [f"cuda:{i}" for i in indices]
    return [f"cpu:{i}" for i in range(max(1, cpu_workers))]
