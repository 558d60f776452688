"""accelerate's fp16 on the appliance under ``djinn run`` (Note [accelerate's fp16]).

Note [accelerate's fp16]: ``Accelerator(mixed_precision="fp16")`` (and so
``TrainingArguments(fp16=True)``, in most fine-tuning recipes) checks its device's type
against a literal tuple of the types it knows have fp16 autocast and a ``GradScaler``,
and refuses any other: "fp16 mixed precision requires a device in ('xpu', 'cuda', ...)
(not 'remote_accelerator')". Past that check it does what a CUDA script does by hand:
``torch.autocast(device.type, torch.float16)`` around the forward (the remote device's
autocast has CUDA's policy: autocast.py) and ``torch.amp.GradScaler("cuda")``, which
``djinn run`` maps to the appliance as it maps the script's own. Both are what
``tests/training/cnn_amp.py`` runs against local eager.

So under ``djinn run`` the remote device type joins that tuple: the constant in
``Accelerator.__init__``'s code is replaced by the same tuple plus ours, once accelerate is
imported (Note [on import]), and put back when ``djinn run`` ends. The tuple is found by
its content (strings, among them "cuda", "xpu" and "mps"); an accelerate whose
``__init__`` holds no such tuple, or more than one, is left as it is, and its refusal
stands.
"""

from __future__ import annotations

import logging
from typing import Any

from .device import DEVICE_TYPE
from .on_import import forget, when_loaded

log = logging.getLogger("djinn.frontend")

_MODULE = "accelerate.accelerator"
_KNOWN = frozenset({"cuda", "xpu", "mps"})


def _fp16_devices(const: Any) -> bool:
    return (
        isinstance(const, tuple) and all(isinstance(c, str) for c in const) and set(const) >= _KNOWN
    )


def _admit(module: Any) -> Any:
    """Add the remote device type to ``module.Accelerator``'s fp16 devices; the code it
    had, to put back (None: nothing changed)."""
    init = getattr(getattr(module, "Accelerator", None), "__init__", None)
    code = getattr(init, "__code__", None)
    if code is None:
        return None
    consts = list(code.co_consts)
    found = [i for i, c in enumerate(consts) if _fp16_devices(c)]
    if len(found) != 1 or DEVICE_TYPE in consts[found[0]]:
        log.debug("djinn: accelerate's fp16 device check not found; left as it is")
        return None
    consts[found[0]] = (*consts[found[0]], DEVICE_TYPE)
    init.__code__ = code.replace(co_consts=tuple(consts))
    return code


def attach() -> Any:
    """Admit the remote device to accelerate's fp16, now or once accelerate is imported."""
    return when_loaded(_MODULE, _admit)


def detach(state: Any) -> None:
    """Undo ``attach``: the finder taken out, or ``Accelerator.__init__``'s code put back."""
    module, code = forget(state)
    if module is not None and code is not None:
        module.Accelerator.__init__.__code__ = code
