"""A noise-prediction model trained and sampled with explicit generators, as diffusion
scripts do: ``torch.Generator(device).manual_seed(...)`` for the noise, passed as
``generator=`` to ``torch.randn`` on the device, to ``normal_``, ``torch.multinomial`` and
``torch.poisson``, and a CPU generator for the DataLoader's shuffle."""

import torch
from common import device, report

g = torch.Generator(device=device).manual_seed(7)
assert isinstance(g, torch.Generator)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(9, 32), torch.nn.SiLU(), torch.nn.Linear(32, 8)).to(
    device
)
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
data = torch.utils.data.DataLoader(
    torch.randn(64, 8), batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(1)
)
losses = []
for _ in range(2):
    for x0 in data:
        x0 = x0.to(device)
        t = torch.rand(x0.shape[0], 1, generator=g, device=device)
        noise = torch.randn(x0.shape, generator=g, device=device)
        xt = (1 - t).sqrt() * x0 + t.sqrt() * noise
        loss = torch.nn.functional.mse_loss(model(torch.cat([xt, t], 1)), noise)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
sampler = torch.Generator(device).manual_seed(3)
with torch.no_grad():
    x = torch.randn(4, 8, generator=sampler, device=device)
    for step in range(5, 0, -1):
        t = torch.full((4, 1), step / 5, device=device)
        x = x - 0.1 * model(torch.cat([x, t], 1))
        x = x + 0.01 * torch.empty_like(x).normal_(generator=sampler)
    picks = torch.multinomial(x.softmax(1), 3, generator=sampler)
    counts = torch.poisson(x.abs() * 4, sampler)  # its schema takes the generator by position
losses += x.flatten().tolist() + picks.flatten().float().tolist() + counts.flatten().tolist()
report(losses, model)
