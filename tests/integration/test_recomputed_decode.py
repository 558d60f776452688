"""KV caches evicted by dropping and recomputing them from their tokens (issue 9 §3, Note
[kv recompute]): a greedy decode interrupted by evictions gives identical tokens whether
the worker recomputes its cache or swaps it, and the stats say which it did."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import wait_for
from tests.integration.test_memory_pressure import MEMORY, _call, _gpt2

transformers = pytest.importorskip("transformers")


def _interrupted_decode(app, steps: int = 5) -> tuple[list[int], list[int], dict]:
    """Decode ``steps`` tokens while another session's long prefill on another model
    evicts this session's cache before every step; returns (tokens, the undisturbed
    local tokens, this session's stats row once its evictions show)."""
    from djinn.frontend import remote_module

    mine, theirs = _gpt2(2), _gpt2(3)
    torch.manual_seed(0)
    prompt = torch.randint(0, 1000, (1, 400))  # a 3.3 MB cache
    long = torch.randint(0, 1000, (1, 700))
    with app.connect() as client, client.session() as s, client.session() as other:
        fp = remote_module.register(mine, s)["fingerprint"]
        other_fp = remote_module.register(theirs, other)["fingerprint"]
        logits, cache = _call(s, fp, prompt)
        tokens, their_cache = [], []
        for _ in range(steps):
            nxt = logits[:, -1:].argmax(-1)
            tokens.append(int(nxt))
            _, c = _call(other, other_fp, long, free=their_cache)  # evicts mine
            their_cache = [c]
            logits, cache = _call(s, fp, nxt, past=cache)

        def row():
            # the worker pushes its stats now and then: wait until the row counts every
            # eviction and what brought each cache back (a swap-in or a recompute)
            r = next(r for r in client.stats()["sessions"] if r["id"] == s.id)
            back = r["swaps_in"] + r["recomputes"]
            return r if r["evictions"] >= steps - 1 and back >= steps - 1 else None

        stats = wait_for(row)
    with torch.no_grad():
        want = mine.generate(prompt, max_new_tokens=steps, do_sample=False, pad_token_id=0)
    return tokens, want[0, prompt.shape[1] :].tolist(), stats


@pytest.mark.parametrize("policy", ["semantic", "lru"])
def test_a_greedy_decode_whose_cache_is_recomputed_gives_identical_tokens(fresh_appliance, policy):
    app = fresh_appliance(cpu_worker_memory=MEMORY, memory_policy=policy, kv_recompute="always")
    tokens, want, row = _interrupted_decode(app)
    assert tokens == want
    # (its swaps, if any, are of its other tensors: the logits it holds also move)
    assert row["recomputes"] >= 4
    mem = app.stats()["memory"][0]
    assert mem["kv_recompute"] == "always" and mem["recomputes"] >= 4


def test_with_recompute_never_the_cache_is_swapped(fresh_appliance):
    app = fresh_appliance(cpu_worker_memory=MEMORY, kv_recompute="never")
    tokens, want, row = _interrupted_decode(app)
    assert tokens == want
    assert row["recomputes"] == 0 and row["swaps_in"] >= 4


def test_auto_swaps_when_the_copy_back_is_cheaper_than_the_prefill(fresh_appliance):
    """On a CPU worker the copy back (a memcpy) is far cheaper than a 400-token prefill,
    both measured by the worker: 'auto' swaps. (When the prefill is cheaper, or the host
    tier has no room, it recomputes: tests/unit/test_kv_recompute.py.)"""
    app = fresh_appliance(cpu_worker_memory=MEMORY, kv_recompute="auto")
    tokens, want, row = _interrupted_decode(app, steps=3)
    assert tokens == want
    assert row["recomputes"] == 0 and row["swaps_in"] >= 2
