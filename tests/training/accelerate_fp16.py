"""A GPT-2 fine-tuned with accelerate in fp16 (``mixed_precision="fp16"``), or the same
steps written by hand (``by_hand``): the forward under ``torch.autocast`` in float16, the
loss scaled by a ``GradScaler``, gradients unscaled and clipped, the step and the scale's
update. accelerate does the second on a CUDA device and nothing on the CPU (it trains in
float32 there), so the CPU reference of the first is the second."""

import sys

import torch
from common import device, report
from transformers import GPT2Config, GPT2LMHeadModel

by_hand = sys.argv[2:] == ["by_hand"]
torch.manual_seed(0)
cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32,
                 resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)  # fmt: skip
model = GPT2LMHeadModel(cfg)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
batches = torch.randint(0, 128, (5, 4, 16), generator=torch.Generator().manual_seed(1))
losses = []
if by_hand:
    model.to(device).train()
    scaler = torch.amp.GradScaler(device, growth_interval=2)
    for x in batches:
        x = x.to(device)
        with torch.autocast(device, dtype=torch.float16):
            loss = model(x, labels=x).loss
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(loss.item())
else:
    from accelerate import Accelerator
    from accelerate.utils import GradScalerKwargs

    acc = Accelerator(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(growth_interval=2)])
    assert acc.scaler is not None, "accelerate runs fp16 without a scaler: not on a GPU-like device"
    model, opt = acc.prepare(model, opt)
    model.train()
    for x in batches:
        x = x.to(acc.device)
        with acc.autocast():
            loss = model(x, labels=x).loss
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    model = acc.unwrap_model(model)
report(losses, model)
