"""The device seam: where tensors live on a worker and how bytes get there.

``CpuDevice`` keeps a tensor put through the arena *in its slab* (zero copies on the
worker side); ``CudaDevice`` copies it to the GPU from the page-locked arena (DMA) and
gives the slab back. Everything else in the worker is written against this interface,
so all but the GPU-marked tests run on a laptop.
"""

from __future__ import annotations

import logging

import psutil
import torch

log = logging.getLogger("djinn.appliance.device")


class CpuDevice:
    kind = "cpu"
    adopts_host_memory = True

    def __init__(self, index: int, memory: int | str) -> None:
        self.index = index
        self.torch_device = torch.device("cpu")
        self.name = f"cpu:{index}"
        self._memory = memory

    def capacity(self, workers: int) -> int:
        if self._memory != "auto":
            return int(self._memory)
        return psutil.virtual_memory().total // 2 // max(1, workers)

    def register_host_memory(self, address: int, size: int) -> bool:
        return False  # nothing to pin: the CPU reads shared memory directly

    def from_host(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def synchronize(self) -> None:
        pass

    def memory_figures(self) -> None:
        return None  # the VMU's accounting is all there is: no allocator of its own

    def healthy(self) -> bool:
        return True  # a CPU kernel's failure is an exception, never a lost device


class CudaDevice:
    kind = "cuda"
    adopts_host_memory = False

    def __init__(self, index: int, memory: int | str = "auto") -> None:
        self.index = index
        self.torch_device = torch.device("cuda", index)
        torch.cuda.set_device(self.torch_device)
        self.name = f"cuda:{index} ({torch.cuda.get_device_name(index)})"
        self._memory = memory

    def capacity(self, workers: int) -> int:
        """``gpu_worker_memory``, at most 90% of what the GPU has free now: the rest is
        for the CUDA context and the allocator's slack (an operator who shares the card
        with other programs gives less)."""
        free, _total = torch.cuda.mem_get_info(self.torch_device)
        ceiling = int(free * 0.9)
        if self._memory == "auto":
            return ceiling
        if int(self._memory) > ceiling:
            log.warning(
                "gpu_worker_memory = %d bytes, but %s has %d free: the VMU gets %d",
                int(self._memory), self.name, free, ceiling,
            )  # fmt: skip
            return ceiling
        return int(self._memory)

    def register_host_memory(self, address: int, size: int) -> bool:
        """Page-lock the arena so host<->device copies from it are DMA."""
        if not size:
            return False
        err = torch.cuda.cudart().cudaHostRegister(address, size, 0)
        ok = int(getattr(err, "value", err)) == 0
        if not ok:
            log.warning("cudaHostRegister of the host arena failed (%s); copies will stage", err)
        return ok

    def from_host(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.torch_device, non_blocking=False)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.torch_device)

    def healthy(self) -> bool:
        """Note [a lost GPU context]: False once the CUDA context is unusable. A kernel's
        device-side assert (an index out of range reaches the GPU, where CPU kernels
        raise) or an illegal address is *sticky*: every later CUDA call of this process
        fails the same way, for every session on the worker (seen on an H200: one
        embedding with an out-of-range index, then 50 other tests' ops failed). A
        synchronize is the probe: it raises exactly when the context is lost."""
        try:
            torch.cuda.synchronize(self.torch_device)
        except Exception:  # torch.AcceleratorError (RuntimeError before 2.8)
            return False
        return True

    def memory_figures(self) -> dict[str, int] | None:
        """Note [device memory figures]: what the CUDA allocator of this worker holds
        (``allocated``: live tensors; ``reserved``: its cached blocks too) and what the
        driver says of the whole card (``free`` / ``total``), beside which the VMU's
        accounted ``used`` can be checked: the VMU charges every tensor it creates, so
        ``allocated`` exceeds it only by what the worker holds outside the VMU (the CUDA
        context's own allocations are in neither; they show in ``total - free``)."""
        try:
            free, total = torch.cuda.mem_get_info(self.torch_device)
        except Exception:  # a lost context (Note [a lost GPU context]): no figures
            return None
        return {
            "allocated": int(torch.cuda.memory_allocated(self.torch_device)),
            "reserved": int(torch.cuda.memory_reserved(self.torch_device)),
            "free": int(free),
            "total": int(total),
        }


def open_device(
    spec: str, memory: int | str, gpu_memory: int | str = "auto"
) -> CpuDevice | CudaDevice:
    kind, _, index = spec.partition(":")
    if kind == "cuda":
        return CudaDevice(int(index or 0), gpu_memory)
    return CpuDevice(int(index or 0), memory)
