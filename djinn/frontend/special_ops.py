"""The ops capture does not record as they come, and what it does instead.

``lazy.dispatch`` looks each op up in ``lazy.SPECIAL`` (filled here, when the frontend's
kernels are registered) before capturing it: reading a value (``.item()``), ``detach`` (an
alias, nothing to run), ``copy_`` (an upload when a fresh allocation takes a CPU tensor
whole), attention reached whole (Note [fused attention]), slices to the end (Note [slices to
the end]), the embedding's gradient (Note [embedding backward]) and an embedding bag's
forward and gradient (Note [embedding bags]); and a move to the CPU,
where a module's tied parameter stays one (Note [tied parameters]).
"""

from __future__ import annotations

from typing import Any

import torch

from djinn.errors import UnsupportedOp
from djinn.protocol.tensors import dtype_name
from djinn.runtime.remote import RemoteTensor

from . import (
    attention,
    embedding,
    embedding_bag,
    inference_views,
    inplace_views,
    known,
    slicing,
    ties,
    writes,
)
from .immediate import fetch, run_locally
from .lazy import (
    SPECIAL,
    SPECIAL_TO_CPU,
    LazyTensor,
    Uninit,
    capture,
    ref_for_node,
    snapshot,
    spec_of,
    streamed,
    upload,
)
from .nodes import KNOWN_CLONES
from .trace import Node, Pending, bind, current, flush


def _to_cpu(func: Any, args: tuple, kwargs: dict) -> Any:
    """A remote tensor moved to the CPU; a module's parameter keeps its object (Note
    [parameters keep their identity]), and a tied one stays one parameter there too (Note
    [tied parameters])."""
    x = args[0]
    at = ties.slot(x)
    tied = ties.converting(at, x, kwargs.get("dtype") or x.dtype, kwargs["device"])
    if tied is not None:
        return tied
    out = _fetched(func, x, kwargs) if len(args) == 1 else run_locally(func, args, kwargs)
    # its gradient, if the parameter keeps its object, moves as it does (Note [parameters
    # keep their identity])
    ties.converted(at, x, lambda grad: func(grad, **kwargs))
    return out


# Note [a fetched value is the copy]: `.cpu()` of a remote tensor is `_to_copy` to the CPU,
# which must return a new tensor. The value a fetch returns is one: fresh memory the
# reply's bytes were copied into once, held by nothing else. Running `_to_copy` on it
# copied every byte a second time (12.9 MB of GPT-2 logits: 0.25 ms warm, 2.5 ms when the
# allocator hands out fresh pages). So when `_to_copy` would make the same tensor (same
# dtype, strided, not pinned, the strides preserve_format keeps) from a value that owns
# exactly its bytes, the value is the result. Anything else copies, as before.
_AS_IS = {"device", "dtype", "layout", "pin_memory", "non_blocking", "memory_format"}


def _fetched(func: Any, x: Any, kwargs: dict) -> Any:
    as_is = (
        isinstance(x, LazyTensor)
        and kwargs.keys() <= _AS_IS
        and kwargs.get("dtype") in (None, x.dtype)
        and kwargs.get("layout") in (None, torch.strided)
        and not kwargs.get("pin_memory")
        and kwargs.get("memory_format") in (None, torch.preserve_format)
    )
    if not as_is:
        return run_locally(func, (x,), kwargs)
    value = fetch(x)
    storage = value.untyped_storage()
    if (
        value.storage_offset() == 0
        and storage.resizable()  # not a view of a received frame's buffer (TCP)
        and storage.nbytes() == value.numel() * value.element_size()
        and torch.empty_like(value, device="meta").stride() == value.stride()
    ):
        return value
    return func(value, **kwargs)


def _item(func: Any, args: tuple, kwargs: dict) -> Any:
    x = args[0]
    trace = current()
    got = known.evaluate(x, trace) if isinstance(x, LazyTensor) else None
    if got is None:
        return func(fetch(x), *args[1:], **kwargs)
    value, program = got  # Note [values the client knows]
    out = func(value, *args[1:], **kwargs)
    if trace.guards is not None:  # a recording: its replays check the value again
        program.read, program.value = func, out
        trace.guards.append(program)
    elif trace.nodes and not known.computable(trace):
        # sent and waited for as the read did before (Note [values the client knows])
        flush(trace)
    return out


def _detach(func: Any, args: tuple, kwargs: dict) -> Any:
    x = args[0]
    ref = x._ref
    if isinstance(ref, Uninit):
        ref = ref_for_node(x, current())
    with inference_views.view_mode(func, args):  # Note [views in inference mode]
        out = LazyTensor(spec_of(x), ref)  # same value, no autograd history: nothing to run
    out.__dict__["_b"].storage = writes.shared_storage(x)  # Note [writes another thread...]
    return out


def _copy(func: Any, args: tuple, kwargs: dict) -> Any:
    dst, src = args[0], args[1]
    if not isinstance(dst, LazyTensor):
        dst.copy_(fetch(src) if isinstance(src, LazyTensor) else src, **kwargs)
        return dst
    return copy_into(dst, src, kwargs)


def copy_into(dst: LazyTensor, src: Any, kwargs: dict | None = None) -> LazyTensor:
    """``dst.copy_(src)``; a fresh allocation taking a CPU tensor whole is just an upload."""
    kwargs = kwargs or {}
    if (
        isinstance(dst._ref, Uninit)
        and not isinstance(src, LazyTensor)
        and isinstance(src, torch.Tensor)
        and src.device.type == "cpu"
        and src.dtype == dst.dtype
        and src.shape == dst.shape
    ):
        dtype_name(src.dtype)  # one the appliance cannot take is refused here, either way
        trace = current()
        if trace.reads is not None:  # Note [replayable functions]: state it reads
            trace.read(("cpu", id(src)), src)
        # a small one goes inside the graph this thread is capturing, if any (a request
        # of its own each cost GPT-2's captured forward 1.5-4 ms: 24 constants), and is
        # put at once when there is none (Note [puts sent without waiting])
        ref = snapshot(src) if trace.reads is not None or trace.nodes else upload(src)
        if isinstance(ref, RemoteTensor) and ref.strides == tuple(dst.stride()):
            bind(dst, ref)  # `.to(remote)` of a large tensor: uploaded once, nothing else
            if known.exact(src):  # Note [values the client knows]: a mask, token ids
                known.remember(ref, src, writes.shared_storage(dst))
            return dst
        if isinstance(ref, torch.Tensor) and ref.stride() == dst.stride():
            trace = streamed(current())
            node = Node(torch.ops.aten.clone.default, [ref], {}, trace, 1)
            with trace.lock:  # Note [a node and its outputs] (trace.py)
                trace.add(node)
                bind(dst, Pending(node, 0))
            if known.exact(ref):  # Note [values the client knows]: kept once it is sent
                KNOWN_CLONES[node] = (ref, writes.shared_storage(dst))
            return dst
    return capture(torch.ops.aten.copy_.default, (dst, src), kwargs)


def _attention(func: Any, args: tuple, kwargs: dict) -> Any:
    """Reached whole only under inference_mode (Note [composite ops under inference mode]
    in uncaptured.py): the kernel local eager would pick (Note [fused attention])."""
    return attention.scaled_dot_product_attention(*args, **kwargs)


def _slice(func: Any, args: tuple, kwargs: dict) -> Any:
    return capture(func, *slicing.clamped(func, args, kwargs))  # Note [slices to the end]


def _embedding_backward(func: Any, args: tuple, kwargs: dict) -> Any:
    return embedding.dense_backward(*args, **kwargs)  # Note [embedding backward]


def _zero_tensor(func: Any, args: tuple, kwargs: dict) -> Any:
    """``_efficientzerotensor`` (forward-mode AD's zero tangents: ``torch.func.hessian``,
    ``jacfwd``) as ``zeros`` of its size: a zero tensor is an optimisation of PyTorch's
    that skips work on known zeros, with zeros' values; the appliance makes no such
    tensors (the op was UNSUPPORTED_OP)."""
    return torch.ops.aten.zeros.default(*args, **kwargs)


def _embedding(func: Any, args: tuple, kwargs: dict) -> Any:
    embedding.refuse_sparse_gradient(args, kwargs)  # Note [sparse embeddings]
    return capture(func, args, kwargs)


def _embedding_bag(func: Any, args: tuple, kwargs: dict) -> Any:
    return embedding_bag.HANDLERS[func](*args, **kwargs)  # Note [embedding bags]


def _resize(func: Any, args: tuple, kwargs: dict) -> Any:
    """``resize_`` to the size a tensor has, with no memory format: a no-op in eager (its
    strides stay). PyTorch's ``out=`` factories resize their target first
    (``torch.zeros(3, out=buf)``, ``torch.arange(n, out=buf)``, ``torch.randn``), and the
    appliance runs no ``resize_``: each was refused (a review). Another size still is,
    at the call (an empty one's was met at its next read: a hunt)."""
    self, size = args  # memory_format is keyword-only
    layout = kwargs.get("memory_format")
    if tuple(self.shape) == tuple(size) and (
        layout is None or (layout is torch.contiguous_format and self.is_contiguous())
    ):
        return self
    raise UnsupportedOp(
        f"resize_ of a remote tensor to another size ({tuple(self.shape)} to {tuple(size)}, "
        "or another memory format): the appliance runs no resize_; make a tensor of that "
        "size instead (torch.empty(size, device=...))"
    )


def _set_source(func: Any, args: tuple, kwargs: dict) -> Any:
    """``x.set_(y)``: ``x`` now shares ``y``'s storage, sizes and strides. Taken as
    ``x.data = y`` takes them (the wrapper's metadata and ``y``'s value, Note [shapes
    changed in place]); the appliance runs no ``set_``. PyTorch's parametrizations do it
    to a remote parameter (``register_parametrization`` after the move, ``m.weight = X``
    on a parametrized module): it was refused, and the error met at a later, unrelated
    line (a hunt). Only tensor to tensor, of one dtype, both remote."""
    self, source = args
    if type(self) is LazyTensor and self._dyn is None and isinstance(source, torch.Tensor):
        if type(source) is not LazyTensor:  # at the call, as eager refuses it (a review)
            raise UnsupportedOp(
                f"set_: a remote tensor cannot take the storage of a {source.device} "
                "tensor; move it first (x.set_(y.to(x.device)))"
            )
        if source.dtype == self.dtype:
            self.data = source
            return self
    return capture(func, args, kwargs)


SPECIAL.update(
    {
        torch.ops.aten.set_.source_Tensor: _set_source,
        torch.ops.aten.resize_.default: _resize,
        torch.ops.aten.scaled_dot_product_attention.default: _attention,
        torch.ops.aten._local_scalar_dense.default: _item,
        torch.ops.aten.is_nonzero.default: _item,
        torch.ops.aten.detach.default: _detach,
        torch.ops.aten.copy_.default: _copy,
        **dict.fromkeys(slicing.OPS, _slice),
        **dict.fromkeys(inplace_views.OPS, inplace_views.reshape_in_place),
        embedding.OP: _embedding_backward,
        embedding.FORWARD: _embedding,
        torch.ops.aten._efficientzerotensor.default: _zero_tensor,
        **dict.fromkeys(embedding_bag.HANDLERS, _embedding_bag),
    }
)
SPECIAL_TO_CPU[torch.ops.aten._to_copy.default] = _to_cpu
