"""``repr()`` of a remote tensor: local eager's text for its values, with what eager
would say of a tensor on an accelerator."""

from __future__ import annotations

import torch


def remote_repr(t: torch.Tensor, local: torch.Tensor) -> str:
    """``t``'s text, ``local`` its values on the CPU: the device first among the suffixes,
    then the size and dtype, then ``grad_fn`` or ``requires_grad``; a parameter as
    ``Parameter containing:``."""
    text = repr(local)
    tail = _value_suffixes(local) + ")"
    body, tail = (text[: -len(tail)], tail) if text.endswith(tail) else (text[:-1], ")")
    if t.grad_fn is not None:
        grad = f", grad_fn=<{type(t.grad_fn).__name__}>"
    else:
        grad = ", requires_grad=True" if t.requires_grad else ""
    text = f"{body}, device='{t.device}'{tail[:-1]}{grad})"
    if isinstance(t, torch.nn.Parameter):
        text = "Parameter containing:\n" + text
    return text


def _value_suffixes(local: torch.Tensor) -> str:
    """The suffixes eager's repr gives a CPU tensor of ``local``'s values: its size when
    it is empty and not 1-d, its dtype when not a default one (``torch._tensor_str``)."""
    text = ""
    if local.numel() == 0 and local.dim() != 1:
        text += f", size={tuple(local.shape)}"
    default_complex = torch.cdouble if torch.get_default_dtype() == torch.double else torch.cfloat
    if local.dtype not in (torch.get_default_dtype(), default_complex, torch.int64, torch.bool):
        text += f", dtype={local.dtype}"
    return text
