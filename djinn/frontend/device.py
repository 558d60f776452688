"""The ``remote_accelerator`` device: the one place that touches PyTorch's backend hooks.

Note [python backend]: ``rename_privateuse1_backend`` alone makes the device string legal,
but a tensor subclass on that device *aborts the process* (a C++ error, no exception) as
soon as autograd touches a leaf that requires grad, because PyTorch has no device guard
for it. ``_setup_privateuseone_for_python_backend`` (experimental, private) also
registers a Python device guard, hooks and a device module (``device_module.py``, what
``torch.remote_accelerator`` is), after which LazyTensors work through forward and
``backward()``. The API may move between PyTorch releases, so it is
called only here and ``tests/unit/test_device_backend.py`` pins the behaviour we rely on.
"""

from __future__ import annotations

import threading

import torch

DEVICE_TYPE = "remote_accelerator"

_lock = threading.Lock()
_registered = False


def register() -> None:
    """Make ``remote_accelerator[:i]`` a legal device and route factories to Djinn."""
    global _registered
    with _lock:
        if _registered:
            return
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

        if torch._C._get_privateuse1_backend_name() == "privateuseone":
            from . import device_module

            _setup_privateuseone_for_python_backend(
                rename=DEVICE_TYPE, backend_module=device_module
            )
        elif torch._C._get_privateuse1_backend_name() != DEVICE_TYPE:
            raise RuntimeError(
                "another PrivateUse1 backend is registered "
                f"({torch._C._get_privateuse1_backend_name()}); Djinn cannot share it"
            )
        from . import factories

        factories.install()
        _registered = True


def device(index: int = 0) -> torch.device:
    """``torch.device("remote_accelerator", index)``."""
    register()
    return torch.device(DEVICE_TYPE, index)


def is_remote(dev: object) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == DEVICE_TYPE
    if isinstance(dev, str):
        return dev.split(":", 1)[0] == DEVICE_TYPE
    return False
