"""Phase and modality detection on real model structures (meta tracing, no appliance)."""

from __future__ import annotations

import pytest
import torch

from djinn.semantics.analyze import analyze

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def gpt2():
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000)
    return transformers.GPT2LMHeadModel(cfg).eval()


def test_gpt2_prefill_then_decode(gpt2):
    ids = torch.randint(0, 1000, (1, 24))
    prefill = analyze(gpt2, ids)
    assert prefill.phase == "llm_prefill" and prefill.modality == "text"
    assert {m.pattern for m in prefill.matches} >= {"llm", "attention"}
    with torch.no_grad():
        cache = gpt2(ids, use_cache=True).past_key_values
    decode = analyze(gpt2, ids[:, -1:], past_key_values=cache)
    assert decode.phase == "llm_decode"
    assert decode.context.has_kv_cache


def test_bert_encoder_is_a_text_forward():
    cfg = transformers.BertConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=1000,
    )
    a = analyze(transformers.BertModel(cfg).eval(), input_ids=torch.randint(0, 1000, (2, 12)))
    assert a.phase == "forward" and a.modality == "text"
    assert a.matches[0].pattern == "text_encoder"


def test_cnn_is_vision_encoding():
    cnn = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3),
        torch.nn.BatchNorm2d(16),
        torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(32, 10),
    ).eval()
    a = analyze(cnn, torch.randn(2, 3, 32, 32))
    assert a.phase == "vision_encoding" and a.modality == "vision"
    conv = next(n for n in a.srg.nodes if n.op == "aten::convolution.default")
    assert conv.module == "Sequential.0" and conv.flops > 0


class TwoTower(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.text = torch.nn.Embedding(5000, 64)
        self.image = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3),
            torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(),
            torch.nn.Linear(16, 64),
        )
        self.head = torch.nn.Linear(128, 2)

    def forward(self, tokens, image):
        return self.head(torch.cat([self.text(tokens).mean(1), self.image(image)], -1))


def test_two_tower_text_image_model_is_fusion():
    a = analyze(TwoTower(), torch.randint(0, 5000, (2, 8)), torch.randn(2, 3, 16, 16))
    assert a.phase == "multimodal_fusion" and a.modality == "fusion"
    fused = a.matches[0].details["first_fusion_node"]
    assert a.srg.nodes[fused].op == "aten::cat.default"


def test_embedding_heavy_recommendation_model():
    class Rec(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tables = torch.nn.ModuleList(
                [torch.nn.EmbeddingBag(10000, 32, mode="sum") for _ in range(4)]
            )
            self.mlp = torch.nn.Linear(128, 1)

        def forward(self, idx):
            return self.mlp(
                torch.cat([t(idx[:, i : i + 1]) for i, t in enumerate(self.tables)], -1)
            )

    a = analyze(Rec(), torch.randint(0, 10000, (4, 4)))
    assert a.matches[0].pattern == "recommendation"
    assert a.matches[0].details["tables"] == 4


def test_analysis_is_cached_per_signature_bucket(gpt2):
    a = analyze(gpt2, torch.randint(0, 1000, (1, 20)))
    assert analyze(gpt2, torch.randint(0, 1000, (1, 22))) is a  # same length bucket
    assert analyze(gpt2, torch.randint(0, 1000, (1, 200))) is not a


def test_weights_and_costs_are_annotated(gpt2):
    a = analyze(gpt2, torch.randint(0, 1000, (1, 16)))
    kinds = {i.kind: i.residency for i in a.srg.inputs}
    assert kinds["weight"] == "persistent_weight"
    assert a.cost is not None and a.cost.model == "roofline" and a.cost.seconds > 0
    assert a.hints()["flops"] == a.srg.total_flops > 0
    assert all(n.phase == "llm_prefill" for n in a.srg.nodes)


def test_analysis_does_not_touch_the_model_or_its_inputs(gpt2):
    before = {n: p.clone() for n, p in gpt2.named_parameters()}
    ids = torch.randint(0, 1000, (1, 8))
    analyze(gpt2, ids)
    for n, p in gpt2.named_parameters():
        assert p.device.type == "cpu" and torch.equal(p, before[n])
