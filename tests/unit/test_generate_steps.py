"""Which generate() calls run as batchable decode steps (appliance/generate_steps.py), and
how many tokens they add: transformers' rules for max_new_tokens and max_length."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from djinn.appliance.generate_steps import _eos, _new_tokens, _plain_generate
from djinn.protocol.tensors import to_wire

transformers = pytest.importorskip("transformers")


def _config(**kw):
    return SimpleNamespace(**{"max_new_tokens": None, "max_length": 20, "eos_token_id": 7, **kw})


def test_new_tokens_follow_transformers_precedence():
    assert _new_tokens(_config(), {"max_new_tokens": 5, "max_length": 100}, 3) == 5
    assert _new_tokens(_config(), {"max_length": 10}, 3) == 7
    assert _new_tokens(_config(max_new_tokens=4), {}, 3) == 4
    assert _new_tokens(_config(), {}, 3) == 17  # the config's max_length, prompt included
    assert _new_tokens(_config(), {"max_length": 3}, 3) is None  # nothing to add


def test_end_of_sequence_ids():
    assert _eos(_config(), {}) == {7}
    assert _eos(_config(), {"eos_token_id": [1, 2]}) == {1, 2}
    assert _eos(_config(eos_token_id=None), {}) == set()
    assert _eos(_config(), {"eos_token_id": [1.5]}) is None


def _fakes(model, batch_max: int = 8):
    entry = SimpleNamespace(module=model, fingerprint="f" * 32, name="gpt2")
    worker = SimpleNamespace(
        batcher=SimpleNamespace(max_size=batch_max),
        models=SimpleNamespace(entries={entry.fingerprint: entry}),
        device=SimpleNamespace(torch_device=torch.device("cpu")),
    )
    session = SimpleNamespace(models={entry.fingerprint}, handles={}, objects={})
    return worker, session


def _frame(ids: torch.Tensor, **kwargs):
    desc, flat = to_wire(ids)
    body = {
        "fingerprint": "f" * 32,
        "method": "generate",
        "args": [{"$t": 0, "desc": desc}],
        "kwargs": kwargs,
    }
    return SimpleNamespace(body=body, segments=[memoryview(flat.numpy())])


def _gpt2(**generation):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    for k, v in generation.items():
        setattr(model.generation_config, k, v)
    return model


def test_only_plain_greedy_generate_runs_as_decode_steps():
    ids = torch.tensor([[1, 2, 3]])
    worker, session = _fakes(_gpt2())
    plan = _plain_generate(worker, session, _frame(ids, max_new_tokens=4, do_sample=False))
    assert plan is not None and plan[4] == 4 and torch.equal(plan[3], ids)
    refused = [
        _frame(ids, max_new_tokens=4, do_sample=True),  # sampling
        _frame(ids, max_new_tokens=4, num_beams=2),  # beams
        _frame(ids, max_new_tokens=4, repetition_penalty=1.3),  # a logits processor
        _frame(torch.tensor([[1, 2, 3], [4, 5, 6]]), max_new_tokens=4),  # a batch of two
    ]
    for frame in refused:
        assert _plain_generate(worker, session, frame) is None, frame.body["kwargs"]
    masked = _frame(ids, max_new_tokens=4)
    mask_desc, mask = to_wire(torch.tensor([[0, 1, 1]]))  # left padding: not a plain prompt
    masked.body["kwargs"]["attention_mask"] = {"$t": 1, "desc": mask_desc}
    masked.segments.append(memoryview(mask.numpy()))
    assert _plain_generate(worker, session, masked) is None
    # the model's own generation config can add processors too
    worker, session = _fakes(_gpt2(no_repeat_ngram_size=2))
    assert _plain_generate(worker, session, _frame(ids, max_new_tokens=4)) is None
    worker, session = _fakes(_gpt2(), batch_max=1)  # batching off: transformers' loop
    assert _plain_generate(worker, session, _frame(ids, max_new_tokens=4)) is None
