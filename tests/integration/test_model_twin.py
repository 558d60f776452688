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
