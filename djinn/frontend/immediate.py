"""Ops that cannot wait for a flush: run at once on the appliance (``_run_now``: a
value-dependent shape, a Python result, no meta kernel), a remote tensor's value read
(``fetch``), and ops whose result lives on the CPU, run locally on fetched inputs
(``run_locally``).

Below ``lazy`` in the import order (lazy.py imports this module): the ``LazyTensor``
class and ``lazy.ref_for_node`` are given by ``attach`` once lazy.py defined them, as
``hook_errors`` is given the class.
"""

from __future__ import annotations

from typing import Any

import torch

from djinn.errors import UnsupportedOp
from djinn.runtime.remote import RemoteTensor

from . import hooks, writes
from . import trace as trace_mod
from .meta import TensorSpec
from .trace import Node, Pending, current, flush

LazyTensor: Any = None  # the LazyTensor class, given by ``attach``
ref_for_node: Any = None  # lazy.ref_for_node, given by ``attach``


def attach(lazy: type, ref_for: Any) -> None:
    """Take the ``LazyTensor`` class and ``lazy.ref_for_node`` (lazy.py, once it defined
    them)."""
    global LazyTensor, ref_for_node
    LazyTensor, ref_for_node = lazy, ref_for


def _run_now(func: Any, trace: trace_mod.Trace, ref_args: list, ref_kwargs: dict, rng: Any,
             args: tuple, kwargs: dict) -> Any:  # fmt: skip
    """Ops whose output shape depends on values (nonzero, unique...), that return Python
    values (equal) or that have no meta kernel (``_sample_dirichlet``: a random op, with
    the generator state ``rng`` it runs with, Note [seeded ops]): run the trace up to and
    including them, keep the tensor outputs. What they write is recorded as a captured
    op's is (``SGD(fused=True)``'s step: a review found another thread's pending read
    taking the stepped value)."""
    returns = [str(r.type) for r in func._schema.returns]
    if any(r not in ("Tensor", "bool", "int", "float", "Scalar") for r in returns):
        raise UnsupportedOp(f"{func}: returns {returns}, which cannot be computed remotely yet")
    node = Node(func, ref_args, ref_kwargs, trace, len(returns), multi=len(returns) > 1)
    node.rng = rng
    writes.record_writes(node, func, args, kwargs)  # Note [writes another thread captured]
    if not returns:  # writes only (the fused optimizers' steps): nothing to wait for
        node.module = hooks.module_path()
        trace.add(node)
        return None
    tensor_idx = [i for i, r in enumerate(returns) if r == "Tensor"]
    refs = [Pending(node, i) for i in range(node.nout)]
    values = flush(
        trace,
        fetch=[r for i, r in enumerate(refs) if i not in tensor_idx],
        keep=[refs[i] for i in tensor_idx],
        add=node,  # Note [a node and its outputs] (trace.py)
    )
    fetched, kept = values
    out: list[Any] = []
    fi = iter(fetched)
    ki = iter(kept)
    for i in range(len(returns)):
        if i in tensor_idx:
            remote: RemoteTensor = next(ki)
            spec = TensorSpec(remote.dtype, tuple(remote.shape), remote.strides, 0, None)
            out.append(LazyTensor(spec, remote))
        else:
            value = next(fi)
            out.append(value.item() if isinstance(value, torch.Tensor) else value)
    return out[0] if len(out) == 1 else tuple(out)


# -- materialisation -------------------------------------------------------------------------
def fetch(t: LazyTensor) -> torch.Tensor:
    """The value of ``t`` as a CPU tensor (runs everything this thread captured so far)."""
    trace = current()
    ref = ref_for_node(t, trace)
    value = flush(trace, fetch=[ref])[0][0]
    storage = t.__dict__["_b"].storage
    if storage is not None and storage.failed is not None:
        # a write into it, in that graph after the op that made ``ref``, failed: Note [a
        # failed write's views] (failures.py)
        raise trace_mod.reported(storage.failed)
    return value


def run_locally(func: Any, args: tuple, kwargs: dict) -> Any:
    """An op whose result lives on the CPU (``.cpu()``, ``.to("cpu")``): read the remote
    inputs, then run it locally."""

    def local(x: Any) -> Any:
        if isinstance(x, LazyTensor):
            return fetch(x)
        if type(x) in (list, tuple):
            return type(x)(local(v) for v in x)
        return x

    return func(*[local(v) for v in args], **{k: local(v) for k, v in kwargs.items()})
