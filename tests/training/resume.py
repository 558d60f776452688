"""Save a checkpoint mid-training, load it into a fresh model and optimizer, go on."""

import sys

import torch
from common import device, report

torch.manual_seed(0)


def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    model = model.to(device)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


model, opt = make()
x, y = torch.randn(10, 5).to(device), torch.randn(10, 2).to(device)
losses = []


def step() -> None:
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    losses.append(loss.item())


for _ in range(3):
    step()
path = sys.argv[1] + ".ckpt"
torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
model, opt = make()
state = torch.load(path, map_location=device)
model.load_state_dict(state["model"])
opt.load_state_dict(state["opt"])
for _ in range(3):
    step()
report(losses, model)
