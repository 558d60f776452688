"""How busy a worker's device is, as the worker itself measures it (issue 16 §7).

The worker runs on the appliance's host, so its figure is right wherever `djinn top` or
`djinn status` runs (a TUI asking NVML on its own machine is right only on that host).

- CUDA device: NVML's utilisation rate, the share of the last sample period in which a
  kernel ran (``source: "nvml"``), and NVML's used and total memory of the GPU
  (``memory_used`` / ``memory_total``, bytes: every process's, the CUDA contexts
  included, which is what an operator sizing the card needs).
- CPU device: there is no device counter to ask, so the worker reports what it knows
  honestly: the CPU time its own process used (every thread: intra-op threads included)
  over wall time, as a share of the CPUs it may run on (``source: "process_cpu"``).
  100 % means every allowed core was busy with this worker.
"""

from __future__ import annotations

import os
import re
import time
from typing import Any

MIN_INTERVAL_S = 1.0  # shorter samples of process CPU time are mostly noise


class Utilisation:
    def __init__(self, device: str) -> None:
        m = re.match(r"cuda:(\d+)", device)
        self._gpu_index = int(m.group(1)) if m else None
        self._nvml: Any = None
        self._handle: Any = None  # NVML's handle of this GPU, asked for once
        self.source = "nvml" if m else "process_cpu"
        self._cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        self._last = (time.monotonic(), _cpu_seconds())
        self._percent: float | None = None

    def sample(self) -> dict[str, Any]:
        """``{"percent": float | None, "source": str}``; None while nothing is known."""
        if self._gpu_index is not None:
            out: dict[str, Any] = {"percent": self._nvml_percent(), "source": self.source}
            out.update(self._nvml_memory())
            return out
        now, cpu = time.monotonic(), _cpu_seconds()
        wall = now - self._last[0]
        if wall >= MIN_INTERVAL_S:
            share = (cpu - self._last[1]) / wall / max(1, self._cores)
            self._percent = round(min(100.0, max(0.0, 100.0 * share)), 1)
            self._last = (now, cpu)
        return {"percent": self._percent, "source": self.source}

    def _nvml_percent(self) -> float | None:
        if self._nvml is False:
            return None
        try:
            if self._nvml is None:
                import pynvml

                pynvml.nvmlInit()
                self._nvml = pynvml
            if self._handle is None:
                self._handle = self._nvml.nvmlDeviceGetHandleByIndex(self._gpu_index)
            return float(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu)
        except Exception:  # no NVML, or the query unsupported here: unknown, and stays so
            self.source = "nvml (unavailable)"
            self._nvml = False
            return None

    def _nvml_memory(self) -> dict[str, int]:
        """NVML's ``{"memory_used", "memory_total"}`` of this GPU; empty when unknown (a
        driver that refuses the query leaves the utilisation figure alone)."""
        if not self._nvml:
            return {}
        try:
            info = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
            return {"memory_used": int(info.used), "memory_total": int(info.total)}
        except Exception:
            return {}


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system
