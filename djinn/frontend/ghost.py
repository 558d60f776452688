"""Ghost loading: a transformers model whose weights never exist on the client.

The client builds the model's *structure* with every parameter on the meta device (no
memory), and the appliance loads the weights from its own disk (``Session.load``: an
allowlisted directory, safetensors only). Each parameter then becomes a LazyTensor bound
to the loaded handle, so calling the model runs on the appliance like any remote module.
Buffers the checkpoint does not hold (position ids and the like) are built locally as
the model's constructor makes them, then uploaded.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch

from djinn.errors import InvalidArgument

from . import registered_weights
from .device import DEVICE_TYPE, is_remote
from .extension_points import parameters_on_meta, register


def _owner(model: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return (model.get_submodule(path) if path else model), leaf


def _lookup(loaded: dict[str, Any], name: str, prefix: str) -> Any:
    for key in _candidates(name, prefix):
        if key in loaded:
            return loaded.pop(key)
    return None


def from_pretrained(
    path: str | os.PathLike, model_class: Any = None, *, index: int = 0, model_path: bool = True
) -> Any:
    """Load a transformers model by ghost loading (weights stay on the appliance).

    ``path`` is a model directory (``config.json`` + ``*.safetensors``) that both this
    machine (for the config) and the appliance (for the weights, under its
    ``model_roots``) can read. ``model_class`` defaults to ``transformers.AutoModel``.

    By default the model is registered on the model path under a fingerprint of its class,
    config and weight bytes (hashed by the appliance), so every session loading the same
    files shares one copy and later loads read nothing. ``model_path=False`` gives a
    module of LazyTensors instead (the graph path: trainable, per session).
    """
    from transformers import AutoConfig, AutoModel

    from .session import default_session

    register()
    device = torch.device(DEVICE_TYPE, index)
    path = os.path.abspath(os.fspath(path))
    config = AutoConfig.from_pretrained(path)
    cls = model_class or AutoModel
    build = getattr(cls, "from_config", None) or cls._from_config  # Auto* or a concrete class
    with parameters_on_meta():
        model = build(config)
    model.eval()
    session = default_session()
    if model_path:
        return _register_ghost(model, path, session, device)
    return _bind_graph_path(model, session.load(path), path, device)


def _register_ghost(model: Any, path: str, session: Any, device: torch.device) -> Any:
    """Model path: the appliance reads the files itself; the fingerprint covers their
    content hash, how the model's names map onto theirs, and the buffers the model builds
    (the appliance verifies all three). Nothing is loaded if the model is cached."""
    from djinn.protocol.fingerprint import model_fingerprint

    from . import model_changes, remote_module

    info = session.inspect_weights(path)
    in_files = set(info["names"])
    prefix = getattr(model, "base_model_prefix", "")
    name_map: dict[str, str] = {}
    local: dict[str, torch.Tensor] = {}
    buffers = dict(model.named_buffers())
    for name, _ in [*model.named_parameters(), *buffers.items()]:
        found = next((key for key in _candidates(name, prefix) if key in in_files), None)
        if found is not None:
            name_map[name] = found
        elif name in buffers:
            local[name] = buffers[name]  # built by the constructor, not in the files
        else:
            raise InvalidArgument(f"weight {name} missing from {path}")
    class_path = remote_module._class_path(type(model))
    config_json = remote_module._config_json(model)
    fp = model_fingerprint(
        class_path, config_json, local.items(), content_hash=info["content_hash"], name_map=name_map
    )
    body = {
        "fingerprint": fp,
        "class": class_path,
        "config_json": config_json,
        "name": type(model).__name__,
    }
    reply = session.register_model(body)
    loaded = not reply["cached"]
    if loaded:
        handles = {}
        for name, r in zip(local, session.put_many(list(local.values())), strict=True):
            r._finalizer.detach()  # the appliance takes it over
            handles[name] = r.handle
        reply = session.register_model(
            {**body, "path": path, "name_map": name_map, "buffers": handles}
        )
    torch.nn.Module.to(model, "meta")
    info = {"fingerprint": fp, "uploaded": False, "loaded_on_appliance": loaded, **reply}
    model._djinn = remote_module._RemoteBinding(fp, session, device, info)
    model._djinn.config = copy.deepcopy(model_changes.config_snapshot(model))
    model._djinn.settings = model_changes.call_settings(model)
    model.__class__ = remote_module._remote_class(type(model))
    model._djinn.owned = True
    registered_weights.own(model, device)
    return model


def _candidates(name: str, prefix: str) -> list[str]:
    out = [name]
    if prefix:
        out += [f"{prefix}.{name}", name.removeprefix(f"{prefix}.")]
    return out


def _bind_graph_path(model: Any, loaded: dict[str, Any], path: str, device: torch.device) -> Any:
    """Graph path: every parameter a LazyTensor bound to its loaded handle."""
    from .lazy import LazyTensor
    from .meta import TensorSpec

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


def hook_transformers() -> None:
    """Opt in: ``SomeModel.from_pretrained(path, device_map="remote_accelerator:0")`` (and
    the Auto classes, which end there) ghost-loads through Djinn."""
    import functools

    from transformers import PreTrainedModel

    if getattr(PreTrainedModel.from_pretrained, "_djinn", False):
        return
    original = PreTrainedModel.from_pretrained.__func__

    @functools.wraps(original)
    def from_pretrained_hook(cls: Any, path: Any, *args: Any, **kwargs: Any) -> Any:
        device_map = kwargs.get("device_map")
        remote = isinstance(device_map, (str, torch.device)) and is_remote(device_map)
        if remote and not args and os.path.isdir(os.fspath(path)):
            index = torch.device(device_map).index or 0
            return from_pretrained(path, model_class=cls, index=index)
        return original(cls, path, *args, **kwargs)

    from_pretrained_hook._djinn = True
    PreTrainedModel.from_pretrained = classmethod(from_pretrained_hook)
