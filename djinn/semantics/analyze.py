"""Semantic analysis of a module call: trace on meta, match patterns, price the graph.

``analyze(module, *args, **kwargs)`` runs the forward on the *meta* device (no data, no
appliance: parameters and inputs are replaced by meta twins), records every aten op into
an SRG with module paths, FLOPs and bytes, then lets the pattern plugins name what it is
(phase, modality) and the first cost model price it. Results are cached per (module,
input-signature bucket), so repeated calls pay a dictionary lookup.

A KV cache argument (``past_key_values``) is not traced through: it marks the call as
cached (decode) and the forward is traced on the new tokens alone.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.flop_counter import flop_registry

from djinn.graph.srg import SRG, SRGEdge, SRGInput, SRGNode, TensorMeta
from djinn.protocol.tensors import DTYPE_NAMES

from .protocols import AnalysisContext, CostEstimate, DeviceSpec, PatternMatch
from .registry import Registry, default_registry

CACHE_KEYS = ("past_key_values", "past_key_value", "cache", "layer_past")


@dataclass
class Analysis:
    phase: str
    modality: str | None
    matches: list[PatternMatch]
    srg: SRG
    cost: CostEstimate | None
    context: AnalysisContext = field(default_factory=AnalysisContext)

    def hints(self) -> dict[str, Any]:
        """The compact form that travels with a call."""
        return {
            "phase": self.phase,
            "modality": self.modality,
            "flops": self.srg.total_flops,
            "est_ms": round(self.cost.seconds * 1e3, 3) if self.cost else None,
            "patterns": [m.pattern for m in self.matches],
        }


def _tmeta(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(
        DTYPE_NAMES.get(t.dtype, str(t.dtype)), list(t.shape), t.numel() * t.element_size()
    )


class _Recorder(TorchDispatchMode):
    def __init__(self, sources: dict[int, tuple[str, str]]) -> None:
        super().__init__()
        self.graph = SRG()
        self.sources = sources  # id(meta tensor) -> (input id, kind)
        self.producer: dict[int, tuple[int, int]] = {}
        self.keep: list[Any] = []  # hold outputs so their ids are not reused mid-trace
        self.seen_inputs: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from djinn.frontend.hooks import module_path

        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        formula = flop_registry.get(func.overloadpacket)
        flops = 0
        if formula is not None:
            try:
                flops = int(formula(*args, **kwargs, out_val=out))
            except Exception:
                flops = 0
        node_id = len(self.graph.nodes)
        node = SRGNode(
            node_id,
            f"{func._schema.name}.{func._overloadname}",
            module_path(),
            outputs=[_tmeta(t) for t in outs],
            flops=flops,
            bytes_read=sum(t.numel() * t.element_size() for t in ins),
            bytes_written=sum(t.numel() * t.element_size() for t in outs),
        )
        self.graph.nodes.append(node)
        for t in ins:
            if id(t) in self.producer:
                src, index = self.producer[id(t)]
            elif id(t) in self.sources:
                src, kind = self.sources[id(t)]
                index = 0
                if src not in self.seen_inputs:
                    self.seen_inputs.add(src)
                    residency = {
                        "weight": "persistent_weight",
                        "kv_cache": "stateful_kv_cache",
                    }.get(kind, "ephemeral_activation")
                    self.graph.inputs.append(SRGInput(src, kind, residency, _tmeta(t)))
            else:
                continue  # a constant made inside the forward
            self.graph.edges.append(SRGEdge(src, node_id, index, _tmeta(t)))
        for k, t in enumerate(outs):
            self.producer[id(t)] = (node_id, k)
        self.keep.append(out)
        return out


def _to_meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(tuple(x.shape), tuple(x.stride()), dtype=x.dtype, device="meta")
    return x


def trace(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[SRG, AnalysisContext]:
    from djinn.frontend.extension_points import FORWARD_HOOKS

    ctx = AnalysisContext(module_class=type(module).__name__)
    kwargs = dict(kwargs)
    for key in CACHE_KEYS:
        if kwargs.get(key) is not None:
            ctx.has_kv_cache = True
            kwargs[key] = None
    for name, value in list(enumerate(args)) + list(kwargs.items()):
        if isinstance(value, torch.Tensor):
            ctx.input_shapes[str(name)] = list(value.shape)
            ctx.input_dtypes[str(name)] = DTYPE_NAMES.get(value.dtype, str(value.dtype))
    state = {n: _to_meta(t) for n, t in (*module.named_parameters(), *module.named_buffers())}
    margs, mkwargs = tree_map(_to_meta, (args, kwargs))
    sources: dict[int, tuple[str, str]] = {}
    params = {n for n, _ in module.named_parameters()}
    for name, t in state.items():
        sources[id(t)] = (f"w:{name}", "weight" if name in params else "buffer")
    for i, t in enumerate(tree_leaves((margs, mkwargs))):
        if isinstance(t, torch.Tensor):
            sources[id(t)] = (f"in:{i}", "input")
    recorder = _Recorder(sources)
    with torch.no_grad(), FORWARD_HOOKS.held(), recorder:
        torch.func.functional_call(module, state, margs, mkwargs, strict=False)
    return recorder.graph, ctx


def annotate(
    graph: SRG,
    ctx: AnalysisContext,
    registry: Registry | None = None,
    device: DeviceSpec | None = None,
) -> Analysis:
    registry = registry or default_registry()
    matches = []
    for plugin in registry.patterns():
        try:
            m = plugin.match(graph, ctx)
        except KeyboardInterrupt:
            raise
        except BaseException:  # a pattern that cannot read this graph simply does not match
            m = None
        if isinstance(m, PatternMatch):
            matches.append(m)
    matches.sort(key=lambda m: -m.confidence)
    phased = [m for m in matches if m.phase]
    phase = phased[0].phase if phased else "forward"
    modality = next((m.modality for m in matches if m.modality), None)
    for node in graph.nodes:
        node.phase = phase
        node.modality = modality
    for m in reversed(matches):  # most confident last, so it wins per node
        for i in m.node_ids:
            if 0 <= i < len(graph.nodes) and m.modality:
                graph.nodes[i].modality = m.modality
    cost = None
    for model in registry.cost_models():
        try:
            cost = model.estimate(graph, device or DeviceSpec())
            break
        except Exception:
            continue
    return Analysis(phase, modality, matches, graph, cost, ctx)


def _bucket(n: int) -> int:
    b = 1
    while b < n:
        b *= 4
    return b


_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_cache_lock = threading.Lock()


def analyze(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Analysis:
    """Analyse ``module(*args, **kwargs)`` without running it (cached per signature)."""
    has_cache = any(kwargs.get(k) is not None for k in CACHE_KEYS)
    sig = (
        has_cache,
        tuple(
            (str(k), v.dtype, tuple(_bucket(d) for d in v.shape))
            for k, v in list(enumerate(args)) + sorted(kwargs.items(), key=lambda kv: str(kv[0]))
            if isinstance(v, torch.Tensor)
        ),
    )
    with _cache_lock:
        per_module = _cache.setdefault(module, {})
        hit = per_module.get(sig)
    if hit is not None:
        return hit
    graph, ctx = trace(module, args, kwargs)
    result = annotate(graph, ctx)
    with _cache_lock:
        per_module[sig] = result
    return result
