"""A model call's memory is charged before it runs (issue 16 §4): a call whose KV cache
would overflow device memory is refused before executing, so the accounting (and, on a
GPU, the allocator) never goes past the budget."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")


def _deep_narrow_gpt2():
    # many layers, tiny vocabulary: the KV cache, not the logits, is what grows
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=16,
        n_embd=64,
        n_head=4,
        vocab_size=16,
        n_positions=1024,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(cfg).eval()


def test_kv_growth_estimate_covers_the_cache_a_call_builds():
    from djinn.appliance import callmemory
    from djinn.appliance.store import _tensors_in

    model = _deep_narrow_gpt2()
    ids = torch.randint(0, 16, (2, 37))
    with torch.no_grad():
        out = model(ids, use_cache=True)
    held = sum(t.untyped_storage().nbytes() for t in _tensors_in(out.past_key_values))
    held += out.logits.untyped_storage().nbytes()
    growth = callmemory.estimate(model, "forward", [ids], {"use_cache": True})
    assert growth.data == held and growth.stack == 0
    gen = callmemory.estimate(model, "generate", [ids], {"max_new_tokens": 5})
    assert gen.data == 0 and gen.stack == 2 * 42 * callmemory.kv_bytes_per_token(model)


def test_a_call_whose_cache_would_overflow_is_refused_before_it_runs(fresh_appliance):
    from djinn.errors import ResourceExhausted
    from djinn.frontend import remote_module
    from djinn.protocol.tensors import to_wire

    app = fresh_appliance(cpu_worker_memory="16MiB")
    model = _deep_narrow_gpt2()
    with app.connect() as client, client.session() as s:
        info = remote_module.register(model, s)
        assert info["cached"] is True
        body = {"fingerprint": info["fingerprint"], "kwargs": {"use_cache": True}}

        def call(batch: int, tokens: int):
            ids = torch.randint(0, 16, (batch, tokens))
            desc, flat = to_wire(ids)
            return s.call_model({**body, "args": [{"$t": 0, "desc": desc}]}, [flat.numpy()])

        call(1, 16)  # a short prefill fits
        with pytest.raises(ResourceExhausted):
            call(3, 1000)  # 3 x 1000 tokens x 16 layers x K,V x 64 x 4 bytes: 24 MB of cache
        vmu = client.stats()["vmu"]["devices"][0]
    for seg in ("text", "data", "stack"):  # nothing was ever held past the budget
        assert vmu[seg]["peak"] <= vmu[seg]["capacity"], (seg, vmu[seg])
