"""``djinn.capture()``: run code that never names a device on the appliance.

Inside the block, factory functions called without a device (``torch.ones(3)``) create
LazyTensors; everything computed from them is captured. The mode lives on PyTorch's
per-thread mode stack, so two threads capturing at once never mix their graphs. The
context also records the ops captured inside it; ``.graph()`` turns them into an SRG.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from .device import DEVICE_TYPE
from .extension_points import FORWARD_HOOKS, register
from .trace import AUTOGRAD_RECORDERS, Node, current

FACTORIES = frozenset(
    {
        torch.tensor,
        torch.arange,
        torch.empty,
        torch.empty_strided,
        torch.eye,
        torch.full,
        torch.linspace,
        torch.logspace,
        torch.ones,
        torch.rand,
        torch.randint,
        torch.randn,
        torch.randperm,
        torch.scalar_tensor,
        torch.zeros,
        torch.as_tensor,
        torch.normal,
        torch.empty_like,
        torch.full_like,
        torch.ones_like,
        torch.rand_like,
        torch.randint_like,
        torch.randn_like,
        torch.zeros_like,
        torch.tril_indices,
        torch.triu_indices,
        torch.bartlett_window,
        torch.hann_window,
        torch.hamming_window,
        torch.blackman_window,
        torch.kaiser_window,
    }
)


class _RemoteFactories(TorchFunctionMode):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.device = torch.device(DEVICE_TYPE, index)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            if func is torch.normal and any(isinstance(a, torch.Tensor) for a in args):
                return func(*args, **kwargs)
            kwargs = {**kwargs, "device": self.device}
            if func is torch.as_tensor:
                func = torch.tensor
        return func(*args, **kwargs)


class capture:
    """Context manager: factories without a device create remote tensors."""

    def __init__(self, index: int = 0) -> None:
        register()
        self._mode = _RemoteFactories(index)
        self.records: list[Any] = []
        self._ids: dict[int, Any] = {}

    def on_node(self, node: Node) -> None:
        from djinn.graph.builder import record

        self.records.append(record(node, self._ids))

    def __enter__(self) -> capture:
        # Module paths come from global forward hooks, attached only while a block is
        # open: ordinary use of PyTorch in the process never pays for them.
        FORWARD_HOOKS.acquire()
        current().recorders.append(self)
        AUTOGRAD_RECORDERS.append(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)
        FORWARD_HOOKS.release()
        for recorders in (current().recorders, AUTOGRAD_RECORDERS):
            if self in recorders:
                recorders.remove(self)

    def graph(self) -> Any:
        """The SRG of every op captured inside the block."""
        from djinn.graph.builder import build_srg

        return build_srg(self.records)
