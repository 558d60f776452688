"""Views made under ``torch.inference_mode()``.

Note [views in inference mode]: under ``torch.inference_mode()`` a view of a normal tensor
is a normal tensor (PyTorch then makes it share its base's version counter). A wrapper made
there is an inference tensor, and every ``split``, ``t()``, ``view`` or ``detach`` of a
remote tensor moved before the block raised "Cannot set version_counter for inference
tensor" (``nn.Transformer``'s decoder under inference_mode). Such a view's outputs are made
with inference mode off.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch


def view_mode(func: Any, args: tuple) -> Any:
    """The mode ``func``'s output wrappers are made in: inference mode off for a view of a
    normal tensor inside ``torch.inference_mode()``, else as it is."""
    if (
        func.is_view
        and torch.is_inference_mode_enabled()
        and args
        and isinstance(args[0], torch.Tensor)
        and not args[0].is_inference()
    ):
        return torch.inference_mode(False)
    return contextlib.nullcontext()
