"""Custom ops written in Python with ``torch.library.custom_op``, on the remote device
(Note [custom ops]).

Note [custom ops]: the appliance runs ``aten`` and ``prims`` ops only (a graph names its
ops, and the worker resolves no other namespace: DESIGN.md's allowlist). An op made with
``torch.library.custom_op`` is a Python function behind a schema; PyTorch's own
``F.linear_cross_entropy`` (2.13) is one, and so are many a library's fused kernels with
a plain PyTorch fallback. Reaching the remote device's kernel it was refused ("not an
aten/prims op name"). When the op has a body for every device (``device_types=None``:
the body is the op's meaning wherever it runs), capture runs that body on the remote
tensors, and the ``aten`` ops it calls are captured as any others. Autograd is above the
device's kernel, so the op's own ``register_autograd`` formula still gives its gradient,
as on the CPU. An op with bodies for named devices only (a CUDA kernel, a CPU one) is
refused as before: which of them would mean the same on the remote device is not known.

PyTorch's own custom ops stay refused too: their bodies pick per-device defaults. The
chunked ``F.linear_cross_entropy`` (``torch_nn::``) resolves its "auto" policy by
``device.type``: "accurate" on the CPU, the accelerators' "compact" elsewhere, so run on
the remote device its half-precision losses were local eager's with
``acc_policy="compact"``, not local eager's (OpInfo, float16 and bfloat16). A body that
branches on ``device.type`` takes its non-CPU branch here, as on CUDA; a user's op that
does so gets what it asked for on an accelerator.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from djinn.errors import UnsupportedOp

_NATIVE = ("aten::", "prims::")
_TORCH_OWN = ("torch_nn::", "torch::", "_c10d_functional::", "inductor::", "higher_order::")
_MISSING = object()
_REFUSED = object()
_bodies: dict[Any, Any] = {}  # op -> its body, None (aten, prims) or _REFUSED


def body(func: Any) -> Callable[..., Any] | None:
    """The device-independent Python body of custom op ``func``; None for an ``aten`` or
    ``prims`` op. Any other op raises UNSUPPORTED_OP at once, before meta inference (an
    op without a fake kernel raised PyTorch's untyped RuntimeError there)."""
    found = _bodies.get(func, _MISSING)
    if found is _MISSING:
        found = _bodies[func] = _find(func)
    if found is _REFUSED:
        name = func._schema.name
        raise UnsupportedOp(
            f"{name}: not an op the remote device runs (a torch.library.custom_op runs "
            "there when its body serves every device: Note [custom ops])"
        )
    return found


def _find(func: Any) -> Any:
    schema = getattr(func, "_schema", None)
    if schema is None or schema.name.startswith(_NATIVE):
        return None
    if schema.name.startswith(_TORCH_OWN):
        return _REFUSED
    from torch._library.custom_ops import _maybe_get_opdef

    try:
        opdef = _maybe_get_opdef(func)
    except Exception:  # not an op of torch.library's
        opdef = None
    fn = getattr(opdef, "_backend_fns", {}).get(None) if opdef is not None else None
    return fn if fn is not None else _REFUSED
