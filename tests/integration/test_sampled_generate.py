"""A sampling generate() on the model path draws eager's tokens under the same seed (Note
[a sampled model call], appliance/call_generator.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from djinn.errors import InvalidArgument
from djinn.protocol.frames import Kind

transformers = pytest.importorskip("transformers")
R = "remote_accelerator:0"
IDS = torch.tensor([[1, 2, 3, 4, 5]])


@pytest.fixture(autouse=True)
def _remote(remote):
    yield


def _gpt2(**generation: object) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    for k, v in generation.items():
        setattr(model.generation_config, k, v)
    return model


def _program(model: torch.nn.Module) -> tuple[list, list, list, torch.Tensor]:
    """Two sampled generate()s and a greedy one under one seed, then a local draw: what
    each gives depends on where the generator was left by the one before."""
    torch.manual_seed(123)
    a = model.generate(IDS, max_new_tokens=10, do_sample=True, pad_token_id=0, top_k=0)
    b = model.generate(IDS, max_new_tokens=10, do_sample=True, temperature=0.7, pad_token_id=0)
    c = model.generate(IDS, max_new_tokens=4, do_sample=False, pad_token_id=0)
    return a.cpu().tolist(), b.cpu().tolist(), c.cpu().tolist(), torch.rand(4)


def test_sampled_generate_draws_eager_tokens_and_moves_the_local_generator_as_eager():
    local = _gpt2()
    model = copy.deepcopy(local).to(R)
    want = _program(local)
    got = _program(model)
    assert got[:3] == want[:3]
    assert torch.equal(got[3], want[3])  # the local generator is where eager left it
    assert want[0] != want[1]  # the second call drew on from where the first stopped
    # the same seed again: the same tokens (before, the appliance's generator moved on)
    assert _program(model)[:2] == want[:2]


def test_generation_config_that_samples_draws_eager_tokens():
    """No do_sample argument: the model's generation_config samples (many chat models')."""
    local = _gpt2(do_sample=True, top_k=20)
    model = copy.deepcopy(local).to(R)
    for m in (local, model):
        torch.manual_seed(7)
        m.out = m.generate(IDS, max_new_tokens=8, pad_token_id=0).cpu().tolist()
    assert model.out == local.out


def test_a_generator_state_of_the_wrong_size_is_refused_typed_and_the_session_goes_on():
    local = _gpt2()
    model = copy.deepcopy(local).to(R)
    session = model._djinn.session
    body = {
        "fingerprint": model._djinn.fingerprint,
        "method": "generate",
        "args": [],
        "kwargs": {"max_new_tokens": 2, "do_sample": True, "pad_token_id": 0},
        "generator": 0,
    }
    with pytest.raises(InvalidArgument, match="generator state of 5056 bytes, not 7"):
        session._call(Kind.CALL, body, [b"\x00" * 7])
    with pytest.raises(InvalidArgument, match="no payload segment 3"):
        session._call(Kind.CALL, {**body, "generator": 3}, [b"\x00" * 7])
    torch.manual_seed(1)
    got = model.generate(IDS, max_new_tokens=5, do_sample=True, pad_token_id=0)
    torch.manual_seed(1)
    want = local.generate(IDS, max_new_tokens=5, do_sample=True, pad_token_id=0)
    assert got.cpu().tolist() == want.tolist()


def test_generation_config_settings_reach_the_appliance_or_are_refused_by_name():
    """Note [generation settings]: a greedy decode with a repetition penalty set on the
    model's generation_config (before, the appliance ran it without the penalty)."""
    from djinn.errors import UnsupportedOp

    local = _gpt2(repetition_penalty=1.5, no_repeat_ngram_size=2)
    model = copy.deepcopy(local).to(R)
    want = local.generate(IDS, max_new_tokens=12, pad_token_id=0).tolist()
    assert want != _gpt2().generate(IDS, max_new_tokens=12, pad_token_id=0).tolist()
    assert model.generate(IDS, max_new_tokens=12, pad_token_id=0).cpu().tolist() == want
    # what the call passes wins over the generation_config, as in transformers
    plain = local.generate(IDS, max_new_tokens=6, pad_token_id=0, repetition_penalty=1.0)
    got = model.generate(IDS, max_new_tokens=6, pad_token_id=0, repetition_penalty=1.0)
    assert got.cpu().tolist() == plain.tolist()
    model.generation_config.max_time = 30.0  # not a setting the appliance takes
    with pytest.raises(UnsupportedOp, match=r"not accepted: max_time .*generation_config"):
        model.generate(IDS, max_new_tokens=2, pad_token_id=0)
