"""Ghost loading: a transformers model whose weights never exist on the client.

The client builds the model's *structure* with every parameter on the meta device (no
memory), and the appliance loads the weights from its own disk (``Session.load``: an
allowlisted directory, safetensors only). Each parameter then becomes a LazyTensor bound
to the loaded handle, so calling the model runs on the appliance like any remote module.
Buffers the checkpoint does not hold (position ids and the like) are built locally as
the model's constructor makes them, then uploaded.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch

from djinn.errors import InvalidArgument

from .device import DEVICE_TYPE, register


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Register every new parameter on the meta device; buffers stay real (they are small
    and often not in checkpoints)."""
    original = torch.nn.Module.register_parameter

    def register_parameter(module: torch.nn.Module, name: str, param: Any) -> None:
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    torch.nn.Module.register_parameter = register_parameter
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original


def _owner(model: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return (model.get_submodule(path) if path else model), leaf


def _lookup(loaded: dict[str, Any], name: str, prefix: str) -> Any:
    for key in (
        name,
        f"{prefix}.{name}" if prefix else None,
        name.removeprefix(f"{prefix}.") if prefix else None,
    ):
        if key and key in loaded:
            return loaded.pop(key)
    return None


def from_pretrained(path: str | os.PathLike, model_class: Any = None, *, index: int = 0) -> Any:
    """Load a transformers model by ghost loading (weights stay on the appliance).

    ``path`` is a model directory (``config.json`` + ``*.safetensors``) that both this
    machine (for the config) and the appliance (for the weights, under its
    ``model_roots``) can read. ``model_class`` defaults to ``transformers.AutoModel``.
    """
    from transformers import AutoConfig, AutoModel

    from .lazy import LazyTensor
    from .meta import TensorSpec
    from .session import default_session

    register()
    device = torch.device(DEVICE_TYPE, index)
    path = os.path.abspath(os.fspath(path))
    config = AutoConfig.from_pretrained(path)
    with parameters_on_meta():
        model = (model_class or AutoModel).from_config(config)
    model.eval()
    loaded = default_session().load(path)
    prefix = getattr(model, "base_model_prefix", "")

    def bind(remote: Any) -> LazyTensor:
        spec = TensorSpec(remote.dtype, tuple(remote.shape), remote.strides, 0, None)
        return LazyTensor(spec, remote)

    missing = []
    for name, param in list(model.named_parameters()):
        remote = _lookup(loaded, name, prefix)
        if remote is None:
            missing.append(name)
            continue
        if tuple(remote.shape) != tuple(param.shape):
            raise InvalidArgument(
                f"{name}: checkpoint has {list(remote.shape)}, the model "
                f"expects {list(param.shape)}"
            )
        owner, leaf = _owner(model, name)
        owner._parameters[leaf] = torch.nn.Parameter(
            bind(remote).to(param.dtype), requires_grad=param.requires_grad
        )
    for name, buf in list(model.named_buffers()):
        owner, leaf = _owner(model, name)
        remote = _lookup(loaded, name, prefix)
        owner._buffers[leaf] = bind(remote) if remote is not None else buf.to(device)
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # tied heads share the embedding's handle
    still_missing = [
        n
        for n in missing
        if _owner(model, n)[0]._parameters[_owner(model, n)[1]].device.type == "meta"
    ]
    if still_missing:
        raise InvalidArgument(f"weights missing from {path}: {', '.join(still_missing[:8])}")
    return model
