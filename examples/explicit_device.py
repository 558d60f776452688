"""The one-line change: put tensors and modules on "remote_accelerator:0" explicitly.

    python examples/explicit_device.py

Trains a small classifier for a few steps on the appliance (an embedded one unless
DJINN_ADDRESS says otherwise) and checks it against the same steps run locally.
"""

from __future__ import annotations

import copy

import torch

import djinn  # noqa: F401 - makes "remote_accelerator" a device

DEVICE = "remote_accelerator:0"


def main() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))
    local = copy.deepcopy(model)
    model = model.to(DEVICE)  # parameters uploaded once, kept on the appliance
    x, y = torch.randn(256, 20), torch.randint(0, 3, (256,))
    xr, yr = x.to(DEVICE), y.to(DEVICE)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    opt_local = torch.optim.Adam(local.parameters(), lr=1e-2)
    for step in range(5):
        losses = []
        for net, o, inp, tgt in ((model, opt, xr, yr), (local, opt_local, x, y)):
            o.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(inp), tgt)
            loss.backward()
            o.step()
            losses.append(loss.item())
        print(f"step {step}: loss remote {losses[0]:.5f}, local {losses[1]:.5f}")
    diff = max(
        (p.cpu() - q).abs().max().item()
        for p, q in zip(model.parameters(), local.parameters(), strict=True)
    )
    accuracy = (model(xr).argmax(-1) == yr).float().mean().item()
    print(f"accuracy on the appliance: {accuracy:.3f}; max |remote - local| weight: {diff:.1e}")


if __name__ == "__main__":
    main()
