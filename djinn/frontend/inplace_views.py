"""A remote tensor's shape changed in place: ``x.unsqueeze_(0)``, ``squeeze_``, ``t_``,
``transpose_``, ``as_strided_`` (Note [shapes changed in place]).

Note [shapes changed in place]: a remote tensor's wrapper is made with its sizes and
strides, and capture mirrors an in-place op's result onto the tensor it wrote, so an op
that changes its argument's *shape* in place was refused ("changes the shape of a remote
tensor in place; use the out-of-place op"). That refused more than programs that do it
themselves: PyTorch's own composite code does it to tensors it has just made, and
``torch.quantile`` (``squeeze_``, ``unsqueeze_`` on its sorted copy) raised on every
remote tensor. In eager, such an op is the out-of-place view, its sizes, strides and
offset then written into the tensor. So it is captured as that view (the appliance makes
the same view of the same storage), and the wrapper takes the view's metadata and value
through ``.data``'s setter (``torch.Tensor.set_data``: sizes, strides, offset, and the
binding, as ``param.data = other`` does). Views taken before keep their own shapes, as
in eager; autograd, above the device's kernels, records the op as it does for any
tensor. A wrapper whose sizes are answered from Python (Note [resizable outputs]) is
written as before.
"""

from __future__ import annotations

from typing import Any

import torch

from .lazy import LazyTensor, capture

_aten = torch.ops.aten
OPS = {
    _aten.t_.default: _aten.t.default,
    _aten.transpose_.default: _aten.transpose.int,
    _aten.unsqueeze_.default: _aten.unsqueeze.default,
    _aten.squeeze_.default: _aten.squeeze.default,
    _aten.squeeze_.dim: _aten.squeeze.dim,
    _aten.squeeze_.dims: _aten.squeeze.dims,
    _aten.as_strided_.default: _aten.as_strided.default,
}


def reshape_in_place(func: Any, args: tuple, kwargs: dict) -> Any:
    x = args[0] if args else None
    if type(x) is not LazyTensor or x._dyn is not None:
        return capture(func, args, kwargs)  # a dynamic wrapper takes the new sizes itself
    view = capture(OPS[func], args, kwargs)
    x.data = view
    return x
