"""Built-in patterns: what kind of model a captured graph is, and which phase a call is in.

Each reads only the SRG (ops, module paths, shapes, inputs) and the analysis context.
Confidence orders them: the most specific structure (fusion > LLM > encoder...) wins.
"""

from __future__ import annotations

from djinn.graph.srg import SRG
from djinn.semantics.protocols import AnalysisContext, PatternMatch

EMBEDDING = {
    "aten::embedding.default",
    "aten::embedding_bag.default",
    "aten::_embedding_bag.default",
    "aten::_embedding_bag_forward_only.default",
}
CONV = {
    "aten::convolution.default",
    "aten::conv2d.default",
    "aten::conv1d.default",
    "aten::conv3d.default",
}
ATTENTION_OPS = {
    "aten::_scaled_dot_product_flash_attention_for_cpu.default",
    "aten::_scaled_dot_product_efficient_attention.default",
    "aten::_scaled_dot_product_flash_attention.default",
    "aten::scaled_dot_product_attention.default",
    "aten::_scaled_dot_product_attention_math.default",
}
SOFTMAX = {"aten::_softmax.default", "aten::softmax.int", "aten::_safe_softmax.default"}
MATMUL = {
    "aten::bmm.default",
    "aten::matmul.default",
    "aten::mm.default",
    "aten::addmm.default",
    "aten::baddbmm.default",
}


def _attention_nodes(graph: SRG) -> list[int]:
    ids = [n.id for n in graph.nodes if n.op in ATTENTION_OPS]
    if not ids:  # eager attention: a softmax inside an attention module, between matmuls
        ids = [
            n.id
            for n in graph.nodes
            if n.op in SOFTMAX and any(k in n.module.lower() for k in ("attn", "attention"))
        ]
    return ids


def _token_embeddings(graph: SRG) -> list[int]:
    """Embedding lookups on integer inputs with a sizeable table (word embeddings)."""
    out = []
    for n in graph.nodes:
        if n.op not in EMBEDDING:
            continue
        feeds = [e for e in graph.edges if e.dst == n.id]
        table = next((e.meta for e in feeds if e.meta.dtype.startswith("float")), None)
        if table is not None and table.shape and table.shape[0] >= 1000:
            out.append(n.id)
    return out


def _conv_nodes(graph: SRG) -> list[int]:
    return [n.id for n in graph.nodes if n.op in CONV]


def _flop_share(graph: SRG, ids: list[int]) -> float:
    total = graph.total_flops
    return sum(graph.nodes[i].flops for i in ids) / total if total else 0.0


class AttentionPattern:
    """Attention / transformer blocks; notes whether a KV cache came in."""

    name = "attention"

    def match(self, graph: SRG, ctx: AnalysisContext) -> PatternMatch | None:
        ids = _attention_nodes(graph)
        if not ids:
            return None
        blocks = {graph.nodes[i].module.rsplit(".", 1)[0] for i in ids}
        return PatternMatch(
            self.name,
            0.3,
            node_ids=ids,
            details={"blocks": len(blocks), "kv_cache": ctx.has_kv_cache},
        )


def _lm_head(graph: SRG, vocab: int) -> bool:
    return any(
        n.op in MATMUL and n.outputs and n.outputs[0].shape and n.outputs[0].shape[-1] == vocab
        for n in graph.nodes
    )


def _vocab(graph: SRG, emb_ids: list[int]) -> int:
    for i in emb_ids:
        for e in graph.edges:
            if e.dst == i and e.meta.dtype.startswith("float"):
                return e.meta.shape[0]
    return 0


class LLMPattern:
    """A causal language model: token embeddings, attention, a head back to the
    vocabulary. Decode when a KV cache comes in with a single new token, else prefill."""

    name = "llm"

    def match(self, graph: SRG, ctx: AnalysisContext) -> PatternMatch | None:
        emb = _token_embeddings(graph)
        attn = _attention_nodes(graph)
        if not emb or not attn or not _lm_head(graph, _vocab(graph, emb)):
            return None
        seq = max((shape[-1] for shape in ctx.input_shapes.values() if len(shape) == 2), default=0)
        decode = ctx.has_kv_cache and seq <= 1
        return PatternMatch(
            self.name,
            0.9,
            "llm_decode" if decode else "llm_prefill",
            "text",
            emb + attn,
            {"new_tokens": seq, "kv_cache": ctx.has_kv_cache},
        )


class TextEncoderPattern:
    """A text encoder (BERT-like): token embeddings and attention, no head to the vocab."""

    name = "text_encoder"

    def match(self, graph: SRG, ctx: AnalysisContext) -> PatternMatch | None:
        emb = _token_embeddings(graph)
        attn = _attention_nodes(graph)
        if not emb or not attn or _lm_head(graph, _vocab(graph, emb)):
            return None
        return PatternMatch(self.name, 0.7, "forward", "text", emb + attn)


class ConvPipelinePattern:
    """Convolutions carrying most of the FLOPs: vision encoding."""

    name = "conv_pipeline"

    def match(self, graph: SRG, ctx: AnalysisContext) -> PatternMatch | None:
        conv = _conv_nodes(graph)
        if not conv or _flop_share(graph, conv) < 0.5:
            return None
        return PatternMatch(
            self.name,
            0.8,
            "vision_encoding",
            "vision",
            conv,
            {"flop_share": round(_flop_share(graph, conv), 3)},
        )


class RecommendationPattern:
    """Embedding-heavy recommendation models: several lookup tables hold most weights."""

    name = "recommendation"

    def match(self, graph: SRG, ctx: AnalysisContext) -> PatternMatch | None:
        lookups = [n.id for n in graph.nodes if n.op in EMBEDDING]
        tables = {
            e.src
            for e in graph.edges
            if e.dst in lookups and isinstance(e.src, str) and e.meta.dtype.startswith("float")
        }
        if len(tables) < 3 or _attention_nodes(graph) or _conv_nodes(graph):
            return None
        weights = sum(i.meta.bytes for i in graph.inputs if i.kind == "weight")
        table_bytes = sum(i.meta.bytes for i in graph.inputs if i.id in tables)
        if not weights or table_bytes / weights < 0.5:
            return None
        return PatternMatch(
            self.name,
            0.75,
            "forward",
            None,
            lookups,
            {"tables": len(tables), "table_share": round(table_bytes / weights, 3)},
        )


class FusionPattern:
    """Vision and text towers whose outputs meet: multimodal fusion."""

    name = "fusion"

    def match(self, graph: SRG, ctx: AnalysisContext) -> PatternMatch | None:
        vision = set(_conv_nodes(graph))
        text = set(_token_embeddings(graph)) or {n.id for n in graph.nodes if n.op in EMBEDDING}
        if not vision or not text:
            return None
        reach_v, reach_t = _descendants(graph, vision), _descendants(graph, text)
        meet = sorted(reach_v & reach_t)
        if not meet:
            return None
        return PatternMatch(
            self.name, 0.95, "multimodal_fusion", "fusion", meet, {"first_fusion_node": meet[0]}
        )


def _descendants(graph: SRG, roots: set[int]) -> set[int]:
    children: dict[int, list[int]] = {}
    for e in graph.edges:
        if isinstance(e.src, int):
            children.setdefault(e.src, []).append(e.dst)
    seen, stack = set(), list(roots)
    while stack:
        for c in children.get(stack.pop(), ()):
            if c not in seen:
                seen.add(c)
                stack.append(c)
    return seen
