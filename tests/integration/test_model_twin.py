"""Note [the model the appliance builds] (djinn/frontend/model_twin.py): the model path
registers a model as class, config and weights, and the appliance builds it from them.
What the program changed in the module that those do not carry was silently not run (a
review): a swapped activation, a module's eps, an untied head, eager attention. Such a
model now takes the graph path, which runs the local module, with a warning; eager
attention travels in the config and keeps the model path."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import transformers

R = "remote_accelerator:0"
transformers.logging.set_verbosity_error()
IDS = torch.tensor([[5, 17, 99, 3], [0, 0, 99, 3]])
MASK = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])  # left padding: eager and sdpa differ there


def _gpt2(**config) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500, **config)
    return transformers.GPT2LMHeadModel(cfg).eval()


def _relu(m):
    for block in m.transformer.h:
        block.mlp.act = torch.nn.ReLU()


def _untie(m):
    m.lm_head = torch.nn.Linear(64, 500, bias=False)


def _truncate(m):
    m.transformer.h = m.transformer.h[:1]


CHANGES = {
    "activation": (_relu, "mlp.act is a ReLU"),
    "eps": (lambda m: setattr(m.transformer.ln_f, "eps", 0.5), "ln_f.eps = 0.5"),
    "config after build": (
        lambda m: setattr(m.config, "layer_norm_epsilon", 0.5),
        "ln_1.eps = 1e-05 .its config builds 0.5.",
    ),
    "untied head": (_untie, "tied otherwise"),
    "layers dropped": (_truncate, "'transformer.h.1' was removed"),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_model_its_config_does_not_build_runs_on_the_graph_path(remote, change):
    edit, words = CHANGES[change]
    model = _gpt2()
    edit(model)
    with torch.no_grad():
        want = copy.deepcopy(model)(IDS, attention_mask=MASK).logits
        with pytest.warns(RuntimeWarning, match=f"takes the graph path.*{words}"):
            model.to(R)
        assert getattr(model, "_djinn", None) is None  # not registered
        got = model(IDS.to(R), attention_mask=MASK.to(R)).logits.cpu()
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_the_attention_implementation_travels_with_the_config(remote, attn):
    model = _gpt2(attn_implementation=attn)
    with torch.no_grad():
        want = copy.deepcopy(model)(IDS, attention_mask=MASK).logits
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            model.to(R)
        assert getattr(model, "_djinn", None) is not None  # the model path
        got = model(IDS, attention_mask=MASK).logits.cpu()
    # the padded positions too: sdpa ran there for an eager model (0.2 off)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def test_settings_that_change_no_output_keep_the_model_path(remote):
    """resize_token_embeddings (it sets vocab_size on the module) and the
    gradient_checkpointing flag sent a model to the graph path (a review)."""
    model = _gpt2()
    model.resize_token_embeddings(512)
    model.transformer.gradient_checkpointing = True  # acts only while training
    with torch.no_grad():
        want = copy.deepcopy(model)(IDS, attention_mask=MASK).logits
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            model.to(R)
        assert getattr(model, "_djinn", None) is not None
        got = model(IDS, attention_mask=MASK).logits.cpu()
    assert torch.allclose(got, want, atol=1e-5)


def test_threads_calling_one_registered_model_see_no_change(remote):
    """The call's analysis swaps the local module's parameters for meta twins while it
    runs; another thread's check took them for a change, and every later call was
    refused (a review: 42 of 45 calls from three threads)."""
    import threading

    model, errors = _gpt2(), []
    want = {n: copy.deepcopy(model)(IDS[:1, :n]).logits for n in (2, 3, 4)}
    model.to(R)

    def run(n: int) -> None:
        try:
            with torch.no_grad():
                for _ in range(6):
                    got = model(IDS[:1, :n]).logits.cpu()
                    assert torch.allclose(got, want[n], atol=1e-5)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(n,)) for n in want]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    with torch.no_grad():
        assert torch.allclose(model(IDS[:1, :4]).logits.cpu(), want[4], atol=1e-5)


def _patch_class(monkeypatch):
    from transformers.models.gpt2 import modeling_gpt2

    plain = modeling_gpt2.GPT2MLP.forward

    def fused(self, hidden_states):  # a kernel library's replacement, other numbers
        return plain(self, hidden_states) * 1.5

    monkeypatch.setattr(modeling_gpt2.GPT2MLP, "forward", fused)


def _patch_partialmethod(monkeypatch):
    import functools

    from transformers.models.gpt2 import modeling_gpt2

    plain = modeling_gpt2.GPT2MLP.forward

    def scaled(self, hidden_states, scale):
        return plain(self, hidden_states) * scale

    monkeypatch.setattr(
        modeling_gpt2.GPT2MLP, "forward", functools.partialmethod(scaled, scale=1.5)
    )


def _patch_instance(m):  # after the build
    import types

    mlp = m.transformer.h[1].mlp
    mlp.forward = types.MethodType(lambda self, h: type(self).forward(self, h) * 1.5, mlp)


def _swap_class(monkeypatch):
    from transformers.models.gpt2 import modeling_gpt2

    class FastMLP(modeling_gpt2.GPT2MLP):  # swapped in before the build
        def forward(self, hidden_states):
            return super().forward(hidden_states) * 1.5

    monkeypatch.setattr(modeling_gpt2, "GPT2MLP", FastMLP)


def _patch_module_function(monkeypatch):
    """A function of the modeling module swapped (a kernel library's rotary embedding)."""
    from transformers.models.gpt2 import modeling_gpt2

    plain = modeling_gpt2.eager_attention_forward

    def fast(*args, **kwargs):
        out, weights = plain(*args, **kwargs)
        return out * 1.5, weights

    monkeypatch.setattr(modeling_gpt2, "eager_attention_forward", fast)


def _patch_torch_function(monkeypatch):
    """torch's own function replaced (F.scaled_dot_product_attention, F.gelu)."""
    plain = torch.nn.functional.scaled_dot_product_attention

    def fast(*args, **kwargs):
        return plain(*args, **kwargs) * 1.5

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", fast)


PATCHES = {
    "class": (_patch_class, r"GPT2MLP\.forward runs code from .*test_model_twin\.py"),
    "partialmethod": (_patch_partialmethod, r"GPT2MLP\.forward runs code from"),
    "instance": (_patch_instance, r"h\.1\.mlp\.forward is another function"),
    "swapped class": (_swap_class, r"FastMLP\.forward runs code from"),
    "module function": (_patch_module_function, r"modeling_gpt2\.eager_attention_forward runs"),
    "torch function": (_patch_torch_function, r"functional\.scaled_dot_product_attention runs"),
}


@pytest.mark.parametrize("how", list(PATCHES))
def test_code_patched_into_the_model_runs_on_the_graph_path(remote, monkeypatch, how):
    """The twin is built from the same patched code, so it showed no difference, and the
    appliance, which imports transformers and torch afresh, ran their own: 0.126 off (a
    review), 0.18 for a partialmethod, 0.15 for a patched torch function."""
    patch, words = PATCHES[how]
    if how != "instance":
        patch(monkeypatch)
    eager = {"attn_implementation": "eager"} if how == "module function" else {}
    model = _gpt2(**eager)
    if how == "instance":
        patch(model)
    with torch.no_grad():
        want = copy.deepcopy(model)(IDS, attention_mask=MASK).logits
        with pytest.warns(RuntimeWarning, match=f"takes the graph path.*{words}"):
            model.to(R)
        assert getattr(model, "_djinn", None) is None
        got = model(IDS.to(R), attention_mask=MASK.to(R)).logits.cpu()
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def test_dynamic_rope_state_stays_each_copys_own(remote):
    """Dynamic RoPE keeps the longest length it has seen. The appliance keeps one module
    per checkpoint: after copy A ran 30 tokens, copy B's first 20-token call was 6.1e-5
    off eager (a review). Such a model runs on the graph path, its state its own."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        num_hidden_layers=1,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=100,
        max_position_embeddings=8,
        rope_scaling={"rope_type": "dynamic", "factor": 2.0},
    )
    base = transformers.LlamaForCausalLM(cfg).eval()
    a, b, ref = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    long, short = torch.arange(30).unsqueeze(0) % 100, (torch.arange(20).unsqueeze(0) * 3) % 100
    with torch.no_grad():
        for m in (a, b):
            with pytest.warns(RuntimeWarning, match="dynamic RoPE"):
                m.to(R)
        a(long.to(R)).logits.cpu()
        got = b(short.to(R)).logits.cpu()
        want = ref(short).logits
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
        # and a copy's own history counts, as in eager: B after a long call of its own
        b(long.to(R)).logits.cpu()
        ref(long)
        got, want = b(short.to(R)).logits.cpu(), ref(short).logits
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def _gemma() -> torch.nn.Module:  # GELUTanh: a functools.partial made by each module
    cfg = transformers.GemmaConfig(
        num_hidden_layers=1,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        vocab_size=100,
    )
    return transformers.GemmaForCausalLM(cfg)


def _wav2vec2() -> torch.nn.Module:  # weight norm: a parametrized class per module
    cfg = transformers.Wav2Vec2Config(
        num_hidden_layers=1,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        vocab_size=30,
        conv_dim=(16, 16),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
    )
    return transformers.Wav2Vec2ForCTC(cfg)


def _hooked_gpt2(monkeypatch) -> torch.nn.Module:
    """After djinn.hook_transformers(), whose from_pretrained is Djinn's own code."""
    from transformers import PreTrainedModel

    import djinn

    monkeypatch.setattr(
        PreTrainedModel, "from_pretrained", PreTrainedModel.__dict__["from_pretrained"]
    )
    djinn.hook_transformers()
    return _gpt2()


@pytest.mark.parametrize("family", ["gemma", "wav2vec2", "hook_transformers"])
def test_unchanged_models_have_no_difference(monkeypatch, family):
    """Three that took the graph path with no change made (a review): a per-module
    partial, a per-module parametrized class, Djinn's own wrapper of from_pretrained."""
    from djinn.frontend import model_twin

    torch.manual_seed(0)
    build = {"gemma": _gemma, "wav2vec2": _wav2vec2}.get(family)
    model = build() if build is not None else _hooked_gpt2(monkeypatch)
    assert model_twin.difference(model.eval()) is None
