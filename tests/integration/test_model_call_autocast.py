"""Note [a model call under autocast] (djinn/frontend/call_settings.py): a registered
model called inside ``torch.autocast`` runs under autocast on its worker, with the
worker's device's policy; on this machine's CPU worker, what eager gives on the CPU.
Before, the call ignored it: float32 logits where eager's are bfloat16, 2.8e-3 off."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

R = "remote_accelerator:0"
IDS = torch.tensor([[3, 4, 5, 6, 7]])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_registered_models_call_under_autocast_is_eagers(remote, dtype):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=300)
    local = transformers.GPT2LMHeadModel(cfg).eval()
    model = copy.deepcopy(local).to(R)
    assert model._djinn is not None  # the model path
    with torch.no_grad():
        with torch.autocast("cpu", dtype=dtype):
            want = local(IDS, use_cache=True)
            want_step = local(IDS[:, -1:], past_key_values=want.past_key_values)
            want_ids = local.generate(IDS, max_new_tokens=4, do_sample=False)
        with torch.autocast(R, dtype=dtype):
            got = model(IDS.to(R), use_cache=True)
            got_step = model(IDS[:, -1:].to(R), past_key_values=got.past_key_values)
            got_ids = model.generate(IDS.to(R), max_new_tokens=4, do_sample=False)
        plain = model(IDS.to(R)).logits  # and out of it, float32 again
    assert got.logits.dtype == want.logits.dtype == dtype
    assert torch.equal(got.logits.cpu(), want.logits)
    assert torch.equal(got_step.logits.cpu(), want_step.logits)
    assert got_ids.tolist() == want_ids.tolist()
    assert plain.dtype == torch.float32
    assert torch.equal(plain.cpu(), local(IDS).logits.detach())
