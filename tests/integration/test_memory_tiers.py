"""Tiers (issue 9 §1): one device budget with text / data / stack as accounting views;
uploads staged in the host arena, not in device memory beside session data."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
MIB = 1 << 20


def _gpt2(n_layer: int, seed: int):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=n_layer, n_embd=768, n_head=12, vocab_size=1000)
    return transformers.GPT2LMHeadModel(cfg).eval()


def _call(session, fp: str, ids: torch.Tensor) -> dict:
    from djinn.protocol.tensors import to_wire

    desc, flat = to_wire(ids)
    body = {"fingerprint": fp, "args": [{"$t": 0, "desc": desc}]}
    return session.call_model(body, [flat.numpy()])


def test_the_issue_repro_two_models_then_one_big_model_fit_a_400mib_worker(fresh_appliance):
    """cpu_worker_memory = 400MiB: two ~114 MiB models registered side by side (refused
    with the fixed 40 % text segment), then one ~168 MiB model (refused while its upload
    was staged in the 40 % data segment)."""
    from djinn.frontend import remote_module

    app = fresh_appliance(cpu_worker_memory="400MiB", arena_bytes="512MiB")
    ids = torch.tensor([[1, 2, 3, 4]])
    with app.connect() as client:
        with client.session() as s:
            fps = []
            for seed in (0, 1):
                model = _gpt2(4, seed)
                info = remote_module.register(model, s)
                assert info["cached"] and info["bytes"] > 100 * MIB
                fps.append((info["fingerprint"], model))
            for fp, model in fps:
                got = _call(s, fp, ids)["out"]["fields"]["logits"]
                want = model(ids).logits
                assert list(got["shape"]) == list(want.shape)
            vmu = client.stats()["vmu"]["devices"][0]
            assert vmu["text"]["used"] > 200 * MIB and vmu["used"] <= vmu["capacity"]
        with client.session() as s:
            big = _gpt2(6, 2)
            info = remote_module.register(big, s)
            assert info["bytes"] > 160 * MIB
            _call(s, info["fingerprint"], ids)
            vmu = client.stats()["vmu"]["devices"][0]
            # the upload was staged in the arena: the device never held it twice
            assert vmu["peak"] <= vmu["capacity"]
