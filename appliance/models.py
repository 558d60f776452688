"""The worker's model cache: modules registered once, shared by every session using them.

A model is built only from a class importable under an allowlisted module prefix
(``model_allowlist``) plus its JSON config, constructed with parameters on the meta
device and then given the uploaded tensors — never from pickled bytes. Its weights are
charged to the VMU *text* segment once, however many sessions use it, and freed when the
last of them is gone.
"""

from __future__ import annotations

import importlib
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from djinn.errors import InvalidArgument, NotFound, UnsupportedOp

from .vmu.device import Segment

log = logging.getLogger("djinn.appliance.models")

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+$")


@dataclass
class ModelEntry:
    fingerprint: str
    name: str
    module: torch.nn.Module
    nbytes: int
    sessions: set[str] = field(default_factory=set)
    hits: int = 0
    storages: set[int] = field(default_factory=set)  # data_ptrs of the weights

    def stats(self) -> dict[str, Any]:
        return {
            # a prefix only: the full fingerprint is what a client presents to attach
            "fingerprint": self.fingerprint[:12],
            "name": self.name,
            "bytes": self.nbytes,
            "sessions": len(self.sessions),
            "hits": self.hits,
        }


def _allowed(path: str, allowlist: list[str]) -> bool:
    return any(path.startswith(p if p.endswith(".") else p + ".") for p in allowlist)


def import_class(path: Any, allowlist: list[str]) -> type:
    """A transformers-style model class (``config_class`` + JSON config) defined under an
    allowlisted module. The class's *defining* module is checked, not just the path used
    to reach it (``transformers.x.torch.nn.Linear`` is torch's class)."""
    if not isinstance(path, str) or not _NAME.match(path) or "__" in path:
        raise InvalidArgument(f"not a class path: {path!r}")
    if not _allowed(path, allowlist):
        raise UnsupportedOp(f"{path} is not under an allowlisted module ({', '.join(allowlist)})")
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):  # longest importable module prefix
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr, None)
        if not (isinstance(obj, type) and issubclass(obj, torch.nn.Module)):
            break
        defined_in = f"{obj.__module__}.{obj.__qualname__}"
        if not _allowed(defined_in, allowlist) or getattr(obj, "config_class", None) is None:
            raise UnsupportedOp(f"{path} is {defined_in}, not an allowlisted model class")
        return obj
    raise NotFound(f"no nn.Module class {path} on the appliance")


# Config keys that make transformers choose code to run (attention kernels fetched from
# the Hub, remote code): only these values are accepted from a client.
_IMPLEMENTATIONS = {None, "eager", "sdpa"}


def sanitize_config(config: dict[str, Any], depth: int = 0) -> dict[str, Any]:
    """Refuse configs that pick code: at any depth, since composite configs (a vision
    encoder's, a text decoder's) are dicts inside the top-level one (issue 17 §7)."""
    if not isinstance(config, dict):
        raise AttributeError("config is not an object")
    if depth > 8:
        raise InvalidArgument("config nested too deeply")
    if config.get("auto_map") or config.get("trust_remote_code"):
        raise UnsupportedOp("configs with auto_map or remote code are not accepted")
    for key, value in config.items():
        if str(key).endswith("_implementation") and value not in _IMPLEMENTATIONS:
            raise UnsupportedOp(f"config {key}={value!r} is not accepted (eager or sdpa)")
        if isinstance(value, dict):
            sanitize_config(value, depth + 1)
    return config


# Config keys that say how many times a block is built. Building happens on meta (no
# memory), but each block is Python objects: n_layer=3000 took 17 s of the worker.
_REPEATS = ("layer", "depth", "blocks")
MAX_REPEATS = 1024


def check_build_size(config: dict[str, Any], weights: int, depth: int = 0) -> None:
    """Refuse, before building, a config that repeats a block more often than the weights
    sent with it could fill: every layer of a model has at least one weight tensor."""
    for key, value in config.items():
        if isinstance(value, dict) and depth < 8:
            check_build_size(value, weights, depth + 1)
        elif (
            type(value) is int
            and any(word in str(key).lower() for word in _REPEATS)
            and value > min(MAX_REPEATS, max(weights, 1))
        ):
            raise InvalidArgument(
                f"config {key}={value} builds more layers than the {weights} weight "
                f"tensors sent could fill (at most {MAX_REPEATS})"
            )


def build(cls: type, config: Any, state: dict[str, torch.Tensor], device: torch.device):
    """Construct ``cls`` from its config entirely on the meta device (a config cannot make
    the worker allocate anything), then give every parameter and buffer a private copy
    of its tensor from ``state``, in the dtype it came in."""
    config_class = getattr(cls, "config_class", None)
    if config_class is None or not isinstance(config, dict):
        raise UnsupportedOp(f"{cls.__name__} has no JSON config: use the graph path")
    with torch.device("meta"):
        module = cls(config_class.from_dict(sanitize_config(config)))
    names = {n for n, _ in module.named_parameters()} | {n for n, _ in module.named_buffers()}
    missing = sorted(names - set(state))
    if missing:
        raise InvalidArgument(f"weights missing for {cls.__name__}: {', '.join(missing[:6])}")
    for name, tensor in state.items():
        path, _, leaf = name.rpartition(".")
        try:
            owner = module.get_submodule(path) if path else module
        except AttributeError:
            raise InvalidArgument(f"{cls.__name__} has no submodule {path}") from None
        # a copy: no session may keep a writable alias of weights other sessions share
        value = tensor.to(device, copy=True)
        if leaf in owner._parameters and owner._parameters[leaf] is not None:
            old = owner._parameters[leaf]
            if tuple(old.shape) != tuple(tensor.shape):
                raise InvalidArgument(
                    f"{name}: got {list(tensor.shape)}, expected {list(old.shape)}"
                )
            owner._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)
        elif leaf in owner._buffers:
            owner._buffers[leaf] = value
        else:
            raise InvalidArgument(f"{cls.__name__} has no parameter or buffer {name}")
    if hasattr(module, "tie_weights"):
        module.tie_weights()
    return module.eval()


def unique_bytes(tensors: Any) -> int:
    """Bytes of distinct tensors (tied weights count once)."""
    seen: dict[tuple[int, int], int] = {}
    for t in tensors:
        seen[(t.data_ptr(), t.numel())] = t.numel() * t.element_size()
    return sum(seen.values())


class ModelCache:
    def __init__(self, text: Segment, allowlist: list[str]) -> None:
        self.text = text
        self.allowlist = allowlist
        self.entries: dict[str, ModelEntry] = {}
        # set by the memory manager: forgets a freed model's host copy and says whether
        # its weights were on the host (then the text segment no longer holds them)
        self.on_free: Callable[[str], bool] = lambda fp: False

    def get(self, fingerprint: Any) -> ModelEntry:
        entry = self.entries.get(fingerprint) if isinstance(fingerprint, str) else None
        if entry is None:
            raise NotFound(f"no model {fingerprint!r} on this worker: register it first")
        return entry

    def add(self, fingerprint: str, name: str, module: torch.nn.Module) -> ModelEntry:
        seen: set[int] = set()
        nbytes = 0
        for t in (*module.parameters(), *module.buffers()):
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                nbytes += t.untyped_storage().nbytes()
        self.text.reserve(nbytes)
        entry = self.entries[fingerprint] = ModelEntry(
            fingerprint, name, module, nbytes, storages=seen
        )
        log.info("model %s (%s) cached: %d bytes", name, fingerprint[:12], nbytes)
        return entry

    def attach(self, entry: ModelEntry, session_id: str) -> None:
        entry.sessions.add(session_id)

    def detach(self, fingerprint: str, session_id: str) -> None:
        entry = self.entries.get(fingerprint)
        if entry is None:
            return
        entry.sessions.discard(session_id)
        if not entry.sessions:  # the last user is gone: the weights go with it
            del self.entries[fingerprint]
            if not self.on_free(fingerprint):
                self.text.release(entry.nbytes)
            log.info("model %s freed", entry.name)

    def stats(self) -> list[dict[str, Any]]:
        return [e.stats() for e in self.entries.values()]
