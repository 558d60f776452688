"""Note [calls run once] (model_handlers.py): a model call refused after the model ran
(its outputs do not fit) leaves the KV cache it was given as it was, and is not queued to
run again on the cache it already grew."""

from __future__ import annotations

import time

import pytest
import torch
import transformers

from djinn.errors import ResourceExhausted
from djinn.frontend import remote_module
from djinn.protocol.tensors import to_wire
from djinn.runtime.remote import RemoteTensor

EMBED = 256


def _gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=EMBED, n_head=4, vocab_size=1000)
    return transformers.GPT2LMHeadModel(cfg).eval()


def _call(session, fp: str, ids: torch.Tensor, past: str | None = None, **kwargs) -> dict:
    desc, flat = to_wire(ids)
    kw = {"use_cache": True, **kwargs}
    if past is not None:
        kw["past_key_values"] = {"$o": past}
    body = {"fingerprint": fp, "args": [{"$t": 0, "desc": desc}], "kwargs": kw}
    return session.call_model(body, [flat.numpy()])["out"]


def _free(client) -> int:
    dev = client.stats()["vmu"]["devices"][0]
    return dev["capacity"] - dev["used"]


@pytest.mark.parametrize("admission_timeout", [0.0, 30.0])
def test_a_call_refused_after_it_ran_leaves_its_cache_as_it_was(fresh_appliance, admission_timeout):
    app = fresh_appliance(cpu_worker_memory="16MiB", admission_timeout=admission_timeout)
    model = _gpt2()
    prompt = torch.randint(0, 1000, (1, 8), generator=torch.Generator().manual_seed(1))
    more = torch.randint(0, 1000, (1, 200), generator=torch.Generator().manual_seed(2))
    with app.connect() as client, client.session() as a, client.session() as b:
        fp = remote_module.register(model, a)["fingerprint"]
        cache = _call(a, fp, prompt)["fields"]["past_key_values"]["$o"]
        time.sleep(1.5)  # the stats document catches up
        # leave room for the call's estimate (its cache growth and logits), not for the
        # hidden states it will also return: those are charged after the model ran
        room = 200 * (2 * 2 * EMBED * 4 + 1000 * 4) + 100_000  # hidden states: 614 KB
        filler = b.put(torch.zeros((_free(client) - room) // 4))  # noqa: F841 - held
        time.sleep(1.5)
        with pytest.raises(ResourceExhausted):
            _call(a, fp, more, past=cache, output_hidden_states=True)
        assert client.stats()["memory"][0]["admission"]["admitted_after_wait"] == 0
        b.close()
        tok = torch.tensor([[7]])
        out = _call(a, fp, tok, past=cache)["fields"]["logits"]
        got = RemoteTensor(a, out["$h"], out).cpu()
    with torch.no_grad():  # the step on a cache of the prompt alone, as if nothing ran
        want = model(tok, past_key_values=model(prompt, use_cache=True).past_key_values).logits
    assert (got - want).abs().max().item() <= 1e-5
