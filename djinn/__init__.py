"""Djinn: remote and shared GPUs that feel local to PyTorch programs.

Kept light on purpose: importing djinn loads neither torch's heavy paths nor the CLI or
TUI; the public names below are imported on first use.
"""

from __future__ import annotations

from typing import Any

from djinn.errors import DjinnError
from djinn.frontend.extension_points import register as _register_device

# `device="remote_accelerator:0"` must work right after `import djinn` (cheap: no I/O).
# Appliance processes import djinn too, but want none of the client's hooks.
if not __import__("os").environ.get("DJINN_APPLIANCE_PROCESS"):
    _register_device()

__version__ = "0.1.0"
__all__ = [
    "Client",
    "DjinnError",
    "RemoteTensor",
    "Session",
    "__version__",
    "analyze",
    "capture",
    "connect",
    "device",
    "from_pretrained",
    "hook_transformers",
]

_LAZY = {
    "connect": ("djinn.runtime.client", "connect"),
    "Client": ("djinn.runtime.client", "Client"),
    "Session": ("djinn.runtime.session", "Session"),
    "RemoteTensor": ("djinn.runtime.remote", "RemoteTensor"),
    "capture": ("djinn.frontend.capture", "capture"),
    "analyze": ("djinn.semantics.analyze", "analyze"),
    "device": ("djinn.frontend.extension_points", "device"),
    "from_pretrained": ("djinn.frontend.ghost", "from_pretrained"),
    "hook_transformers": ("djinn.frontend.ghost", "hook_transformers"),
}


def __getattr__(name: str) -> Any:
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'djinn' has no attribute {name!r}") from None
    import importlib

    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value
