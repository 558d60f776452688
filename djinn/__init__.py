"""Djinn: remote and shared GPUs that feel local to PyTorch programs.

Kept light on purpose: importing djinn loads neither torch's heavy paths nor the CLI or
TUI; the public names below are imported on first use.
"""

from __future__ import annotations

from typing import Any

from djinn.errors import DjinnError

# Commands of djinn's own CLI that never make a remote tensor: their process needs no
# remote device, and so no torch (Note [commands without torch]).
_NO_DEVICE_COMMANDS = frozenset({"serve", "status", "top"})


def _wants_the_device() -> bool:
    """Note [commands without torch]: `import djinn` registers the remote device, which
    imports torch (about 2 s of CPU). Appliance processes import djinn too but want none
    of the client's hooks: a worker says so with DJINN_APPLIANCE_PROCESS, and the
    supervisor (``djinn serve``), ``djinn status`` and ``djinn top`` are known from their
    command line, ``djinn CMD`` or ``python -m djinn[.cli.main] CMD``, before anything
    else is imported. Each imports torch itself if it ever needs it; none uses the
    device. Any other program, ``djinn run`` included, gets the device as before."""
    import os
    import sys

    if os.environ.get("DJINN_APPLIANCE_PROCESS"):
        return False
    argv = list(getattr(sys, "orig_argv", ()))[1:]
    while argv and argv[0].startswith("-") and argv[0] not in ("-c", "-m"):
        del argv[: 2 if argv[0] in ("-W", "-X") else 1]  # the interpreter's own options
    if argv[:1] == ["-m"] and argv[1:2] in (["djinn"], ["djinn.cli.main"]):
        rest = argv[2:]
    elif argv and not argv[0].startswith("-") and os.path.basename(argv[0]) == "djinn":
        rest = argv[1:]  # the `djinn` console script: python .../bin/djinn CMD ...
    else:
        return True
    command = next((a for a in rest if not a.startswith("-")), "")
    return command not in _NO_DEVICE_COMMANDS


# `device="remote_accelerator:0"` must work right after `import djinn` (cheap: no I/O).
if _wants_the_device():
    from djinn.frontend.extension_points import register as _register_device

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
    "replayable",
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
    "replayable": ("djinn.frontend.replayable", "replayable"),
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
