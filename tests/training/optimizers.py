"""Adam and AdamW with foreach=True, fused=True and the defaults, one model each."""

import torch
from common import device, report

torch.manual_seed(0)
variants = [
    (torch.optim.Adam, {"foreach": True}),
    (torch.optim.Adam, {"fused": True}),
    (torch.optim.Adam, {}),
    (torch.optim.AdamW, {"foreach": True}),
    (torch.optim.AdamW, {"fused": True}),
    (torch.optim.AdamW, {"amsgrad": True}),
]
models = torch.nn.ModuleList(torch.nn.Linear(6, 3) for _ in variants).to(device)
opts = [cls(m.parameters(), lr=0.01, **kw) for m, (cls, kw) in zip(models, variants, strict=True)]
x = torch.randn(8, 6).to(device)
losses = []
for _ in range(4):
    for m, opt in zip(models, opts, strict=True):
        opt.zero_grad()
        loss = m(x).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
report(losses, models)
