"""Oversubscription (issue 9 §2, §6): models and KV caches adding up to more than a
worker's memory take turns on the device, swapped through the host arena by the memory
policy; every result equals eager PyTorch, under each built-in policy."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import wait_for
from tests.model_calls import model_call as _call

transformers = pytest.importorskip("transformers")
POLICIES = ["semantic", "lru"]
MEMORY = "24MiB"  # one ~14.6 MB model fits, two do not


def _gpt2(seed: int):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=1000)
    return transformers.GPT2LMHeadModel(cfg).eval()


def _memory_row(client, fp: str) -> dict:
    return next(m for m in client.stats()["models"] if fp.startswith(m["fingerprint"]))


@pytest.mark.parametrize("policy", POLICIES)
def test_models_over_device_memory_take_turns_and_match_eager(fresh_appliance, policy):
    from djinn.frontend import remote_module

    app = fresh_appliance(cpu_worker_memory=MEMORY, memory_policy=policy)
    models = [_gpt2(0), _gpt2(1)]
    ids = torch.tensor([[3, 1, 4, 1, 5, 9]])
    with app.connect() as client, client.session() as s:
        fps = [remote_module.register(m, s)["fingerprint"] for m in models]
        for _round in range(2):
            for fp, model in zip(fps, models, strict=True):
                got, _ = _call(s, fp, ids)
                with torch.no_grad():
                    want = model(ids).logits
                assert (got - want).abs().max().item() <= 1e-5

        def swapped():
            # a worker pushes its stats at most every 0.1 s: wait for the push that has them
            # (and for one in which both models have a row: CI once read a document
            # without one, and next() raised instead of waiting)
            st = client.stats()
            rows = [m for fp in fps for m in st["models"] if fp.startswith(m["fingerprint"])]
            if len(rows) != len(fps):
                return None
            moved = all(r["swaps_in"] >= 1 and r["swaps_out"] >= 1 for r in rows)
            return (st, rows) if moved and st["memory"][0]["swaps_in"] >= 2 else None

        st, rows = wait_for(swapped)
        mem = st["memory"][0]
        assert mem["policy"] == policy
        vmu = st["vmu"]["devices"][0]
        assert vmu["peak"] <= vmu["capacity"]
        # exactly one of the two is on the device, the other waits on the host
        assert sorted(r["host_bytes"] > 0 for r in rows) == [False, True]


@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_decode_interrupted_by_evictions_gives_identical_tokens(fresh_appliance, policy):
    """Between every decode step another session runs a long prefill on another model;
    both cannot share the device, so the first model *and its KV cache* are swapped out
    and back every step, and the tokens are those of an undisturbed local decode."""
    from djinn.frontend import remote_module

    app = fresh_appliance(cpu_worker_memory=MEMORY, memory_policy=policy)
    mine, theirs = _gpt2(2), _gpt2(3)
    torch.manual_seed(0)
    prompt = torch.randint(0, 1000, (1, 400))  # a 3.3 MB cache
    long = torch.randint(0, 1000, (1, 700))  # theirs: 14.6 MB weights + 8.4 MB cache, logits
    with app.connect() as client, client.session() as s, client.session() as other:
        fp = remote_module.register(mine, s)["fingerprint"]
        other_fp = remote_module.register(theirs, other)["fingerprint"]
        logits, cache = _call(s, fp, prompt)
        tokens, their_cache = [], []
        for _ in range(6):
            nxt = logits[:, -1:].argmax(-1)
            tokens.append(int(nxt))
            _, c = _call(other, other_fp, long, free=their_cache)  # evicts mine
            their_cache = [c]
            logits, cache = _call(s, fp, nxt, past=cache)
        # the KV cache did travel (stats are pushed at most every 0.1 s: wait for them)
        wait_for(
            lambda: any(r["id"] == s.id and r["swaps_in"] >= 1 for r in client.stats()["sessions"])
        )
    with torch.no_grad():
        want = mine.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert tokens == want[0, prompt.shape[1] :].tolist()


def test_with_the_policy_off_a_model_that_does_not_fit_is_refused(fresh_appliance):
    from djinn.errors import ResourceExhausted
    from djinn.frontend import remote_module

    app = fresh_appliance(cpu_worker_memory=MEMORY, memory_policy="off")
    with app.connect() as client, client.session() as s:
        remote_module.register(_gpt2(4), s)
        with pytest.raises(ResourceExhausted, match="short"):
            remote_module.register(_gpt2(5), s)
        assert client.stats()["memory"][0]["policy"] == "off"


def test_swaps_and_tiers_show_in_prometheus(fresh_appliance):
    """The same counters as the stats document, on the metrics endpoint (issue 9 §5)."""
    import re
    import urllib.request

    from djinn.frontend import remote_module
    from tests.integration.test_metrics import _free_port, _value

    app = fresh_appliance(cpu_worker_memory=MEMORY, metrics_port=_free_port())
    url = "http://" + re.search(r"metrics=(\S+)", app.readiness).group(1)

    def scrape() -> str:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.read().decode()

    ids = torch.tensor([[1, 2, 3]])
    with app.connect() as client, client.session() as s:
        fps = [remote_module.register(_gpt2(seed), s)["fingerprint"] for seed in (6, 7)]
        for fp in (*fps, *fps):
            _call(s, fp, ids)
        text = wait_for(
            lambda: _value(t := scrape(), "djinn_memory_events_total", event="swaps_in") >= 2 and t
        )
        assert _value(text, "djinn_memory_events_total", policy="semantic", event="evictions") >= 2
        assert _value(text, "djinn_memory_moved_bytes_total", direction="in") > 0
        hosts = [_value(text, "djinn_model_bytes", model=fp[:12], tier="host") for fp in fps]
        assert sorted(h > 0 for h in hosts) == [False, True]  # one waits on the host
        assert _value(text, "djinn_session_bytes", session=s.id, tier="device") > 0


def test_a_training_loop_under_pressure_matches_one_without(fresh_appliance, monkeypatch):
    """Graph-path training whose activations do not fit beside an idle registered model:
    the model is swapped out to make room (session tensors never move), and the trained
    parameters equal a local run's (issue 9 §6)."""
    from djinn.frontend import remote_module, session

    app = fresh_appliance(cpu_worker_memory=MEMORY)
    monkeypatch.setenv("DJINN_ADDRESS", app.unix)
    session.reset()

    def train(device: str) -> list[torch.Tensor]:
        torch.manual_seed(0)
        net = torch.nn.Sequential(
            torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 1)
        ).to(device)
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        x, y = torch.randn(2048, 64), torch.randn(2048, 1)  # 4 MiB per activation
        for _ in range(3):
            opt.zero_grad()
            loss = ((net(x.to(device)) - y.to(device)) ** 2).mean()
            loss.backward()
            opt.step()
        return [p.detach().cpu() for p in net.parameters()]

    try:
        with app.connect() as client, client.session() as idle:
            fp = remote_module.register(_gpt2(10), idle)["fingerprint"]  # 14.6 MB, idle
            remote = train("remote_accelerator:0")
            row = wait_for(lambda: (r := _memory_row(client, fp))["swaps_out"] >= 1 and r)
            assert row["host_bytes"] > 0  # it made room for the activations
    finally:
        session.reset()
    local = train("cpu")
    for got, want in zip(remote, local, strict=True):
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
