"""A transformer encoder with dropout, every layer under activation checkpointing."""

import torch
import torch.utils.checkpoint as cp
from common import device, report

torch.manual_seed(0)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(16, 32)
        self.layers = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True)
            for _ in range(2)
        )
        self.head = torch.nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for i, layer in enumerate(self.layers):
            h = cp.checkpoint(layer, h, use_reentrant=bool(i % 2))  # both flavours
        return self.head(h).mean(dim=1)


model = Net().to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x, y = torch.randn(4, 6, 16), torch.randn(4, 1)
losses = []
for _ in range(3):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))
    loss.backward()
    opt.step()
    losses.append(loss.item())
report(losses, model)
