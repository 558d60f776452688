"""Cross-session batching of a model whose config sets a sliding window (Note [sliding
windows in a batch], appliance/batching.py): every Mistral (``sliding_window`` 4096 by
default) and Qwen2 with ``use_sliding_window``. Their caches are transformers'
sliding-window layers, which count the tokens they have seen; a batched step once grew
them without counting, and greedy ``generate()`` calls of two sessions batched together
got wrong tokens. Batched or not, each session must get what eager PyTorch gives."""

from __future__ import annotations

import contextlib
import threading
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import wait_for
from tests.integration.test_batching import _in_threads
from tests.model_calls import model_call

transformers = pytest.importorskip("transformers")
NEW_TOKENS = 8


def _model(family: str, window: int | None = None):
    torch.manual_seed(0)
    shape = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 500,
    }
    if family == "mistral":  # window None: the config's default, 4096
        extra = {} if window is None else {"sliding_window": window}
        cfg = transformers.MistralConfig(**shape, **extra)
        return transformers.MistralForCausalLM(cfg).eval()
    # layer 0 full attention, layer 1 a sliding window: a hybrid cache
    cfg = transformers.Qwen2Config(
        **shape, use_sliding_window=True, sliding_window=window, max_window_layers=1
    )
    return transformers.Qwen2ForCausalLM(cfg).eval()


def _together(n: int, run) -> None:
    """``run(i, barrier)`` for i in range(n), each in its own thread; errors raised here."""
    barrier = threading.Barrier(n)
    _in_threads(n, lambda i: run(i, barrier), barrier)


def _batching(app, done) -> dict:
    """The worker's batching stats once ``done(stats)`` holds (the stats row is pushed
    apart from replies), or as they are after a while."""
    seen: list[dict] = []

    def check() -> bool:
        with app.connect() as client:
            seen.append(client.stats()["scheduler"][0]["batching"])
        return done(seen[-1])

    with contextlib.suppress(AssertionError):  # the caller's assertion says what is missing
        wait_for(check, timeout=10.0, interval=0.2)
    return seen[-1]


def _generate_together(app, model, prompts) -> dict[int, torch.Tensor]:
    """Plain greedy generate() of each prompt, one session each, all at the same time."""
    from djinn.frontend import remote_module
    from djinn.protocol.tensors import to_wire
    from djinn.runtime.remote import RemoteTensor

    got: dict[int, torch.Tensor] = {}

    def run(i: int, barrier: threading.Barrier) -> None:
        with app.connect() as client, client.session() as s:
            fp = remote_module.register(model, s)["fingerprint"]
            # One decode step first: a session that decoded the model lately is waited for
            # (scheduler.py, DECODERS_RECENT_S), so the generate() loops' first steps meet
            # however far apart their prefills end; without it a tiny model's whole loop
            # may finish before the other session's request arrives.
            logits, cache = model_call(s, fp, prompts[i])
            model_call(s, fp, logits[:, -1:].argmax(-1), past=cache)
            desc, flat = to_wire(prompts[i])
            body = {
                "fingerprint": fp,
                "method": "generate",
                "args": [{"$t": 0, "desc": desc}],
                "kwargs": {"max_new_tokens": NEW_TOKENS, "do_sample": False, "pad_token_id": 0},
            }
            barrier.wait(timeout=60)  # the loops' decode steps meet
            out = s.call_model(body, [flat.numpy()])["out"]
            got[i] = RemoteTensor(s, out["$h"], out).cpu()

    _together(len(prompts), run)
    return got


def _eager(model, prompt: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize(
    ("family", "lengths"),
    [("mistral", (5, 11)), ("qwen2", (5, 11))],
)
def test_batched_generate_within_the_window_is_eager(fresh_appliance, family, lengths):
    """Windows far longer than the sequences (Mistral's default 4096): every decode step
    is batched, and the tokens are eager's."""
    app = fresh_appliance(batch_max=8, batch_wait_us=500_000)  # long: the steps meet
    model = _model(family, window=None if family == "mistral" else 4096)
    torch.manual_seed(1)
    prompts = [torch.randint(0, 500, (1, n)) for n in lengths]
    got = _generate_together(app, model, prompts)
    for i, prompt in enumerate(prompts):
        assert got[i].tolist() == _eager(model, prompt).tolist(), i
    # every decode step of both loops batched (the warm-up steps may add one batch)
    want = 2 * (NEW_TOKENS - 1)
    batching = _batching(app, lambda b: b["calls"] >= want)
    assert batching["largest"] == 2 and batching["calls"] >= want, batching


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_generate_that_outgrows_the_window_leaves_the_batch(fresh_appliance, family):
    """A window of 8 that the sequences outgrow while they generate: their steps are
    batched while every layer holds all they have seen, then run alone (the window has
    dropped tokens); the tokens are eager's all along."""
    app = fresh_appliance(batch_max=8, batch_wait_us=500_000)
    model = _model(family, window=8)
    torch.manual_seed(2)
    prompts = [torch.randint(0, 500, (1, n)) for n in (3, 5)]
    got = _generate_together(app, model, prompts)
    for i, prompt in enumerate(prompts):
        assert got[i].tolist() == _eager(model, prompt).tolist(), i
    batching = _batching(app, lambda b: b["batches"] and b["alone"])
    assert batching["largest"] == 2, batching  # batched within the window
    assert batching["alone"] >= 1, batching  # and alone past it


def test_decode_loops_of_a_sliding_window_model_are_batched(fresh_appliance):
    """The client's own decode loop (a model call per token on a remote cache) of two
    sessions on a Mistral: their steps are batched, and each gets eager's logits."""
    from djinn.frontend import remote_module

    app = fresh_appliance(batch_max=8, batch_wait_us=500_000)
    model = _model("mistral")
    torch.manual_seed(3)
    prompts = [torch.randint(0, 500, (1, n)) for n in (4, 9)]
    got: dict[int, list[torch.Tensor]] = {}

    def run(i: int, barrier: threading.Barrier) -> None:
        with app.connect() as client, client.session() as s:
            fp = remote_module.register(model, s)["fingerprint"]
            logits, cache = model_call(s, fp, prompts[i])
            seen = [logits]
            for _ in range(4):
                barrier.wait(timeout=60)  # the steps arrive together
                logits, cache = model_call(s, fp, logits[:, -1:].argmax(-1), past=cache)
                seen.append(logits)
            got[i] = seen

    _together(len(prompts), run)
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            out = model(prompt, use_cache=True)
            want = [out.logits]
            for _ in range(4):
                nxt = out.logits[:, -1:].argmax(-1)
                out = model(nxt, past_key_values=out.past_key_values, use_cache=True)
                want.append(out.logits)
        for step, (g, w) in enumerate(zip(got[i], want, strict=True)):
            assert g[:, -1].argmax(-1).tolist() == w[:, -1].argmax(-1).tolist(), (i, step)
            assert (g - w).abs().max().item() <= 1e-4, (i, step)
    batching = _batching(app, lambda b: b["batches"])
    assert batching["largest"] == 2, batching


@pytest.mark.parametrize(
    "config",
    [
        {"attention_chunk_size": 8},  # Llama 4's chunks start at absolute positions
        {"layer_types": ["full_attention", "chunked_attention"]},
        {"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 8},
        {"sliding_window": 4096},
    ],
)
def test_only_masks_that_padding_leaves_alone_are_batched(config):
    from appliance.batching import batchable_family

    module = SimpleNamespace(config=SimpleNamespace(model_type="mistral", **config))
    shiftable = "attention_chunk_size" not in config and "chunked_attention" not in str(config)
    assert batchable_family(module) is shiftable
