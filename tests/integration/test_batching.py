"""Cross-session batching of decode steps (issue 10 §4, Note [cross-session batching]):
sessions decoding the same registered model at the same time get their steps run as one
batched forward, and each gets what it would have got alone."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.conftest import wait_for
from tests.model_calls import model_call as _call

transformers = pytest.importorskip("transformers")
SESSIONS = 4
STEPS = 5
PROMPT_LENGTHS = (3, 9, 6, 12)  # caches of different lengths: the batch pads them


def _model(family: str):
    torch.manual_seed(0)
    if family == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500)
        return transformers.GPT2LMHeadModel(cfg).eval()
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=500,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


def _local_steps(model, prompt: torch.Tensor) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and each decode step's logits, in local eager PyTorch."""
    tokens, logits_seen = [], []
    with torch.no_grad():
        out = model(prompt, use_cache=True)
        for _ in range(STEPS):
            nxt = out.logits[:, -1:].argmax(-1)
            tokens.append(int(nxt))
            out = model(nxt, past_key_values=out.past_key_values, use_cache=True)
            logits_seen.append(out.logits)
    return tokens, logits_seen


def _in_threads(n: int, run, barrier=None) -> None:
    """``run(i)`` for i in range(n), each in its own thread; the first error of any is
    raised here (and aborts ``barrier``, so the others do not wait for it)."""
    errors: list[BaseException] = []

    def guarded(i: int) -> None:
        try:
            run(i)
        except BaseException as exc:  # reported by the test's thread
            errors.append(exc)
            if barrier is not None:
                barrier.abort()

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors


def _decode_together(app, model, prompts, barrier=None):
    """One session per prompt, each in its own thread and connection, all decoding the
    same registered model step by step at the same time."""
    from djinn.frontend import remote_module

    results: dict[int, tuple[list[int], list[torch.Tensor]]] = {}

    def run(i: int) -> None:
        with app.connect() as client, client.session() as s:
            fp = remote_module.register(model, s)["fingerprint"]
            logits, cache = _call(s, fp, prompts[i])
            tokens, seen = [], []
            for _ in range(STEPS):
                nxt = logits[:, -1:].argmax(-1)
                tokens.append(int(nxt))
                if barrier is not None:
                    barrier.wait(timeout=60)  # the steps arrive together
                logits, cache = _call(s, fp, nxt, past=cache)
                seen.append(logits)
            results[i] = (tokens, seen)

    _in_threads(len(prompts), run, barrier)
    return results


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_batched_decode_steps_give_each_session_what_it_gets_alone(fresh_appliance, family):
    # a long wait so the steps of all four sessions meet in one batch on a busy machine
    app = fresh_appliance(batch_max=8, batch_wait_us=300_000)
    model = _model(family)
    torch.manual_seed(1)
    prompts = [torch.randint(0, 500, (1, n)) for n in PROMPT_LENGTHS]
    results = _decode_together(app, model, prompts, threading.Barrier(SESSIONS))
    for i, prompt in enumerate(prompts):
        want_tokens, want_logits = _local_steps(model, prompt)
        tokens, logits = results[i]
        assert tokens == want_tokens, i
        for got, want in zip(logits, want_logits, strict=True):
            assert (got - want).abs().max().item() <= 1e-4
    with app.connect() as client:
        batching = wait_for(
            lambda: (b := client.stats()["scheduler"][0]["batching"])["batches"] and b
        )
    assert batching["largest"] >= 2, batching  # steps really were batched
    assert batching["calls"] >= 2 * batching["batches"]


def test_with_batching_off_every_step_runs_alone(fresh_appliance):
    app = fresh_appliance(batch_max=1)
    model = _model("gpt2")
    torch.manual_seed(1)
    prompts = [torch.randint(0, 500, (1, n)) for n in PROMPT_LENGTHS[:2]]
    results = _decode_together(app, model, prompts, threading.Barrier(2))
    for i, prompt in enumerate(prompts):
        assert results[i][0] == _local_steps(model, prompt)[0]
    with app.connect() as client:
        assert client.stats()["scheduler"][0]["batching"]["batches"] == 0


def test_a_step_that_is_not_plain_runs_alone_beside_a_batch(fresh_appliance):
    """A session passing a padded attention mask is not batched (its step is not what a
    lone plain step computes); it runs alone, and its tokens are still right."""
    from djinn.frontend import remote_module
    from djinn.protocol.tensors import to_wire
    from djinn.runtime.remote import RemoteTensor

    app = fresh_appliance(batch_max=8, batch_wait_us=100_000)
    model = _model("gpt2")
    prompt = torch.tensor([[7, 8, 9, 10]])
    with app.connect() as client, client.session() as s:
        fp = remote_module.register(model, s)["fingerprint"]
        _, cache = _call(s, fp, prompt)
        ids = torch.tensor([[11]])
        mask = torch.tensor([[0, 1, 1, 1, 1]])  # the first position masked out
        (d_ids, f_ids), (d_mask, f_mask) = to_wire(ids), to_wire(mask)
        kwargs = {
            "use_cache": True,
            "past_key_values": {"$o": cache},
            "attention_mask": {"$t": 1, "desc": d_mask},
        }
        body = {"fingerprint": fp, "args": [{"$t": 0, "desc": d_ids}], "kwargs": kwargs}
        fields = s.call_model(body, [f_ids.numpy(), f_mask.numpy()])["out"]["fields"]
        got = RemoteTensor(s, fields["logits"]["$h"], fields["logits"]).cpu()
    with torch.no_grad():
        local = model(prompt, use_cache=True)
        want = model(ids, past_key_values=local.past_key_values, attention_mask=mask).logits
    assert (got - want).abs().max().item() <= 1e-5


def test_generate_on_the_appliance_joins_the_batches(fresh_appliance):
    """Plain greedy generate() calls of several sessions run as decode steps batched
    together (generate_steps.py), and each returns what transformers' generate() does."""
    from djinn.frontend import remote_module
    from djinn.protocol.tensors import to_wire
    from djinn.runtime.remote import RemoteTensor

    app = fresh_appliance(batch_max=8, batch_wait_us=300_000)
    model = _model("gpt2")
    torch.manual_seed(2)
    prompts = [torch.randint(0, 500, (1, n)) for n in PROMPT_LENGTHS[:3]]
    barrier, got = threading.Barrier(len(prompts)), {}

    def run(i: int) -> None:
        with app.connect() as client, client.session() as s:
            fp = remote_module.register(model, s)["fingerprint"]
            desc, flat = to_wire(prompts[i])
            body = {
                "fingerprint": fp,
                "method": "generate",
                "args": [{"$t": 0, "desc": desc}],
                "kwargs": {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0},
            }
            barrier.wait(timeout=60)
            out = s.call_model(body, [flat.numpy()])["out"]
            got[i] = RemoteTensor(s, out["$h"], out).cpu()

    _in_threads(len(prompts), run, barrier)
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            want = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert torch.equal(got[i], want), i
    with app.connect() as client:  # the stats row is pushed apart from replies: wait for it
        batching = wait_for(
            lambda: (b := client.stats()["scheduler"][0]["batching"])["batches"] and b
        )
    assert batching["largest"] >= 2, batching
