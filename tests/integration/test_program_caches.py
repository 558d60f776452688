"""Note [a cache the program made] (djinn/frontend/local_caches.py): an empty
``DynamicCache`` the program makes and passes to a registered model's every call, as
transformers' own decoding-loop recipe does, runs as in eager: the program's object is the
cache the calls fill (on the appliance), and the logits are eager's."""

from __future__ import annotations

import copy

import pytest
import torch

from djinn.errors import InvalidArgument, UnsupportedOp

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache  # noqa: E402

R = "remote_accelerator:0"


def _gpt2():
    # its own weights: another file's test expects to be the first to upload its GPT-2
    torch.manual_seed(57)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000)
    return transformers.GPT2LMHeadModel(cfg).eval()


def _loop(model, past, ids, steps=4):
    """transformers' hand-written loop: the same cache object passed to every call, its
    length read from it, never from the output; each step's logits and lengths."""
    seen = []
    with torch.no_grad():
        for _ in range(steps):
            out = model(ids, past_key_values=past, use_cache=True)
            assert out.past_key_values is past  # as eager fills it in place
            seen.append((out.logits.cpu(), past.get_seq_length()))
            ids = out.logits[:, -1:].argmax(-1)
    return seen


@pytest.mark.parametrize("made_with_config", [False, True])
def test_an_empty_cache_the_program_made_is_filled_on_the_appliance(remote, made_with_config):
    local = _gpt2()
    model = copy.deepcopy(local).to(R)
    assert model._djinn is not None  # the model path
    ids = torch.tensor([[1, 2, 3, 4, 5]])

    def cache(m):
        return DynamicCache(config=m.config) if made_with_config else DynamicCache()

    ref = _loop(local, cache(local), ids)
    past = cache(model)
    got = _loop(model, past, ids.to(R))
    for (logits, n), (ref_logits, ref_n) in zip(got, ref, strict=True):
        assert n == ref_n
        assert (logits - ref_logits).abs().max().item() <= 1e-5
    assert isinstance(past, DynamicCache) and past.get_seq_length() == 8
    # what it holds stays on the appliance: said, typed or as a RemoteObject says it
    with pytest.raises(AttributeError, match="stays on the appliance"):
        past.crop(2)
    with pytest.raises(AttributeError, match="stays on the appliance"):
        len(past)
    with pytest.raises(UnsupportedOp, match="cannot be copied"):
        copy.deepcopy(past)
    assert "on the appliance" in repr(past)


def test_a_cache_the_model_would_not_make_itself_is_refused_and_left_as_it_was(remote):
    model = _gpt2().to(R)
    ids = torch.tensor([[1, 2, 3]], device=R)
    full = DynamicCache()
    with torch.no_grad():
        # a tuple out has no place to say where the cache went
        with pytest.raises(InvalidArgument, match="DynamicCache"):
            model(ids, past_key_values=full, use_cache=True, return_dict=False)
        # nor does a call that will use no cache fill it
        with pytest.raises(InvalidArgument, match="DynamicCache"):
            model(ids, past_key_values=full, use_cache=False)
        assert type(full) is DynamicCache and full.get_seq_length() == 0 and not full.layers
        # one that holds tokens already is the program's data: refused as before
        local = _gpt2()
        filled = DynamicCache()
        local(torch.tensor([[1, 2]]), past_key_values=filled, use_cache=True)
        with pytest.raises(InvalidArgument, match="DynamicCache"):
            model(ids, past_key_values=filled, use_cache=True)


@pytest.mark.parametrize("as_dict", [False, True])
def test_generate_fills_the_programs_cache_and_a_second_generate_goes_on_from_it(remote, as_dict):
    """transformers' recipe for a conversation: generate with a cache of one's own, then
    generate again from the whole text with the same cache, which skips what it holds."""
    local = _gpt2()
    model = copy.deepcopy(local).to(R)
    prompt = torch.tensor([[5, 6, 7, 8]])

    def talk(m, ids):
        past = DynamicCache()
        kw = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
        if as_dict:
            kw["return_dict_in_generate"] = True
        with torch.no_grad():
            first = m.generate(ids, past_key_values=past, **kw)
            seq = first.sequences if as_dict else first
            n_first = past.get_seq_length()
            more = torch.cat([seq, torch.tensor([[9, 10]], device=seq.device)], dim=1)
            second = m.generate(more, past_key_values=past, **kw)
            seq2 = second.sequences if as_dict else second
        if as_dict:
            assert first.past_key_values is past and second.past_key_values is past
        else:
            assert isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor)
        return seq.cpu(), n_first, seq2.cpu(), past.get_seq_length()

    ref, got = talk(local, prompt), talk(model, prompt.to(R))
    assert torch.equal(got[0], ref[0]) and torch.equal(got[2], ref[2])
    assert got[1] == ref[1] and got[3] == ref[3]


def test_a_sliding_window_models_cache_must_be_the_one_it_makes(remote):
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=4,
    )
    local = transformers.MistralForCausalLM(cfg).eval()
    model = copy.deepcopy(local).to(R)
    assert model._djinn is not None  # the model path
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    # made without the config: full-attention layers, not the model's own; or with
    # another window (the same classes: a review)
    narrower = copy.deepcopy(cfg)
    narrower.sliding_window = 2
    for other in (DynamicCache(), DynamicCache(config=narrower)):
        with torch.no_grad(), pytest.raises(InvalidArgument, match="DynamicCache"):
            model(ids.to(R), past_key_values=other, use_cache=True)
    ref = _loop(local, DynamicCache(config=local.config), ids, steps=3)
    got = _loop(model, DynamicCache(config=model.config), ids.to(R), steps=3)
    for (logits, n), (ref_logits, ref_n) in zip(got, ref, strict=True):
        assert n == ref_n
        assert (logits - ref_logits).abs().max().item() <= 1e-5


def test_a_call_that_leaves_the_model_path_takes_the_programs_own_cache(remote):
    """A registered model put in training mode leaves the model path at its next call
    (Note [a registered model trains]): that call runs with the program's arguments, its
    cache filled as in eager (a review: it was sent None, the cache stayed empty and the
    next step ran without the prompt)."""
    local = _gpt2()
    local.config.resid_pdrop = local.config.embd_pdrop = local.config.attn_pdrop = 0.0
    for m in local.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    model = copy.deepcopy(local).to(R)
    assert model._djinn is not None
    model.train()
    local.train()
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    ref, got = (
        _loop(local, DynamicCache(), ids, steps=3),
        _loop(model, DynamicCache(), ids.to(R), steps=3),
    )
    for (logits, n), (ref_logits, ref_n) in zip(got, ref, strict=True):
        assert n == ref_n
        assert (logits - ref_logits).abs().max().item() <= 1e-5
    past = DynamicCache()
    with torch.no_grad():
        out = model.generate(ids.to(R), past_key_values=past, max_new_tokens=3, do_sample=False)
    assert isinstance(out, torch.Tensor) and past.get_seq_length() == 7


def test_the_models_own_setting_for_generates_dict_is_kept(remote):
    """``generation_config.return_dict_in_generate``, the model's or the call's: the
    program gets the dict it asked for (a review: the sequences alone)."""
    model = _gpt2().to(R)
    ids = torch.tensor([[1, 2, 3]], device=R)
    kw = {"max_new_tokens": 2, "do_sample": False, "pad_token_id": 0}
    given = copy.deepcopy(model.generation_config)
    given.return_dict_in_generate = True
    with torch.no_grad():
        past = DynamicCache()
        out = model.generate(ids, past_key_values=past, generation_config=given, **kw)
        assert out.past_key_values is past and out.sequences.shape == (1, 5)
        model.generation_config.return_dict_in_generate = True
        past = DynamicCache()
        out = model.generate(ids, past_key_values=past, **kw)
        assert out.past_key_values is past and past.get_seq_length() == 4


def test_the_programs_cache_stays_bound_across_a_recovery(own_frontend):
    """A lost worker's session is rebuilt with the cache under a new id: the program's
    object is still what the outputs hold (a review: they held a bare RemoteObject)."""
    import os
    import signal

    from djinn.frontend import session
    from tests.conftest import wait_for

    local = _gpt2()
    model = copy.deepcopy(local).to(R)
    past, ref_past = DynamicCache(), DynamicCache()
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        for step in range(5):
            if step == 3:
                s = session.default_session()
                pid = next(w["pid"] for w in own_frontend.stats()["workers"] if w["id"] == s.worker)
                os.kill(pid, signal.SIGKILL)
                wait_for(
                    lambda pid=pid: all(
                        w["pid"] != pid or not w["alive"] for w in own_frontend.stats()["workers"]
                    )
                )
            out = model(ids.to(R), past_key_values=past, use_cache=True)
            ref = local(ids, past_key_values=ref_past, use_cache=True)
            assert out.past_key_values is past
            assert past.get_seq_length() == ref_past.get_seq_length()
            assert (out.logits.cpu() - ref.logits).abs().max().item() <= 1e-5
            ids = ref.logits[:, -1:].argmax(-1)
    assert session.default_session().recovery_stats()["recoveries"] >= 1
