"""Building the SRG from captured trace nodes.

``record`` runs at capture time (only while a ``djinn.capture()`` block is recording,
so ordinary capture pays nothing): it notes each input's producer and metadata before
the trace is shipped and the node's arguments are released. ``build_srg`` then turns the
records into nodes, edges and inputs with FLOPs and bytes.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

from djinn.protocol.tensors import DTYPE_NAMES

from .srg import SRG, SRGEdge, SRGInput, SRGNode, TensorMeta

# RemoteTensors holding module parameters, noted at capture (residency: persistent_weight).
WEIGHTS: weakref.WeakSet = weakref.WeakSet()


def _meta(dtype: torch.dtype, shape: tuple[int, ...]) -> TensorMeta:
    n = 1
    for d in shape:
        n *= d
    return TensorMeta(DTYPE_NAMES.get(dtype, str(dtype)), list(shape), n * dtype.itemsize)


class Record:
    # ``node`` is held so that id(node), the key producers are found by, is never reused
    __slots__ = ("flops", "inputs", "module", "node", "node_id", "op", "outputs", "residency")

    def __init__(
        self, node_id: int, node: Any, inputs: list, outputs: list, flops: int, residency: str
    ) -> None:
        self.node_id = node_id
        self.node = node
        self.op = node.name
        self.module = node.module
        self.inputs = inputs  # (producer Record id | input key, output index, TensorMeta, kind)
        self.outputs = outputs
        self.flops = flops
        self.residency = residency


def _flops(op: Any, args: Any, kwargs: Any, specs: Any) -> int:
    formula = flop_registry.get(op.overloadpacket)
    if formula is None:
        return 0
    from djinn.frontend.meta import meta_tensor

    def meta(x: Any) -> Any:
        from djinn.frontend.trace import Pending

        if isinstance(x, _Shape):
            return meta_tensor(x.dtype, x.shape, _contig(x.shape), 0)
        if isinstance(x, (list, tuple)):
            return type(x)(meta(v) for v in x)
        if isinstance(x, Pending):
            return None
        return x

    outs = [meta_tensor(s.dtype, s.shape, s.stride, 0) for s in specs if hasattr(s, "shape")]
    try:
        out_val = outs[0] if len(outs) == 1 else tuple(outs)
        return int(formula(*meta(args), **meta(kwargs), out_val=out_val))
    except Exception:  # a formula that cannot handle these arguments: cost unknown
        return 0


class _Shape:
    __slots__ = ("dtype", "shape")

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        self.dtype = dtype
        self.shape = shape


def _contig(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(out))


def record(node: Any, ids: dict[int, Record]) -> Record:
    """Note what a freshly captured node reads and writes (its args are refs now)."""
    from djinn.frontend.trace import Pending
    from djinn.runtime.remote import RemoteTensor

    inputs: list[tuple] = []

    def shapes(x: Any) -> Any:
        if isinstance(x, Pending):
            producer = ids.get(id(x.node))
            spec = x.node.specs[x.index] if x.node.specs is not None else None
            if spec is None or not hasattr(spec, "shape"):
                return None
            meta = _meta(spec.dtype, spec.shape)
            inputs.append(
                (producer.node_id if producer else f"pending:{id(x.node)}", x.index, meta, "node")
            )
            return _Shape(spec.dtype, spec.shape)
        if isinstance(x, RemoteTensor):
            meta = _meta(x.dtype, tuple(x.shape))
            kind = "weight" if x in WEIGHTS else "handle"
            inputs.append((f"h:{x.handle}", 0, meta, kind))
            return _Shape(x.dtype, tuple(x.shape))
        if isinstance(x, torch.Tensor):
            meta = _meta(x.dtype, tuple(x.shape))
            inputs.append((f"c:{id(x)}", 0, meta, "constant"))
            return _Shape(x.dtype, tuple(x.shape))
        if isinstance(x, (list, tuple)):
            return type(x)(shapes(v) for v in x)
        return x

    args = shapes(node.args)
    kwargs = {k: shapes(v) for k, v in (node.kwargs or {}).items()}
    specs = [s for s in (node.specs or ()) if hasattr(s, "shape")]
    outputs = [_meta(s.dtype, s.shape) for s in specs]
    flops = _flops(node.op, args, kwargs, specs)
    in_backward = torch._C._current_graph_task_id() != -1
    residency = "gradient" if in_backward else "ephemeral_activation"
    rec = Record(len(ids), node, inputs, outputs, flops, residency)
    ids[id(node)] = rec
    return rec


def build_srg(records: list[Record]) -> SRG:
    from djinn.runtime.remote import RemoteTensor

    graph = SRG()
    seen_inputs: dict[str, SRGInput] = {}
    # A value computed inside the block but read from another thread's trace (backward
    # runs on PyTorch's device thread) arrives as a handle: link it to its producer.
    produced: dict[str, tuple[int, int]] = {}
    for rec in records:
        for k, remote in enumerate(rec.node.results or ()):
            if isinstance(remote, RemoteTensor):  # not None, nor a failed write's mark
                produced[f"h:{remote.handle}"] = (rec.node_id, k)
    for rec in records:
        node = SRGNode(
            id=rec.node_id,
            op=rec.op,
            module=rec.module,
            phase="training" if rec.residency == "gradient" else "unknown",
            residency=rec.residency,
            outputs=rec.outputs,
            flops=rec.flops,
            bytes_read=sum(m.bytes for _, _, m, _ in rec.inputs),
            bytes_written=sum(m.bytes for m in rec.outputs),
        )
        graph.nodes.append(node)
        for src, index, meta, kind in rec.inputs:
            if src in produced:
                src, index = produced[src]
            elif kind != "node" and src not in seen_inputs:
                residency = "persistent_weight" if kind == "weight" else "ephemeral_activation"
                seen_inputs[src] = SRGInput(src, kind, residency, meta)
            graph.edges.append(SRGEdge(src, rec.node_id, index, meta))
    graph.inputs = list(seen_inputs.values())
    return graph
