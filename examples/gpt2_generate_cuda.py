"""A small GPT-2 text generation written for CUDA, with no Djinn in it.

Run it unchanged on a machine without a GPU:

    djinn run examples/gpt2_generate_cuda.py --tokens 12

`djinn run` maps `cuda` to the appliance (an embedded one if none is configured), so the
model's weights and every step of `generate()` live there. Random weights (no model hub
here); the printed token ids are what matter: the same as `python` with cuda -> cpu.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=12)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=args.layers, n_embd=128, n_head=4, vocab_size=1000, bos_token_id=1, eos_token_id=2
    )
    model = GPT2LMHeadModel(config).eval().to(device)
    prompt = torch.tensor([[11, 22, 33, 44, 55]], device=device)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=args.tokens, do_sample=False, pad_token_id=0)
    print("tokens:", out[0].tolist())
    print(f"generated {args.tokens} tokens on {device.type} in {time.perf_counter() - start:.2f}s")


if __name__ == "__main__":
    main()
