"""A DataLoader with pin_memory=True feeding non_blocking copies."""

import torch
from common import device, report
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
loader = DataLoader(data, batch_size=16, shuffle=True, pin_memory=True)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
model.to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
losses = []
for _ in range(2):
    for xb, yb in loader:
        xb = xb.to(device, non_blocking=True)
        yb = yb.to(device, non_blocking=True)
        xb.mul_(1.0)  # touch the copy at once: non_blocking must still be complete
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        loss.backward()
        opt.step()
        losses.append(loss.item())
report(losses, model)
