"""A CNN trained with autocast (float16) and a GradScaler."""

import torch
from common import device, report

torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Conv2d(3, 8, 3, padding=1),
    torch.nn.ReLU(),
    torch.nn.MaxPool2d(2),
    torch.nn.Conv2d(8, 8, 3, padding=1),
    torch.nn.ReLU(),
    torch.nn.Flatten(),
    torch.nn.Linear(8 * 4 * 4, 10),
).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
scaler = torch.amp.GradScaler(device)
images, labels = torch.randn(16, 3, 8, 8), torch.randint(0, 10, (16,))
losses = []
for _ in range(5):
    opt.zero_grad()
    with torch.autocast(device_type=device, dtype=torch.float16):
        logits = model(images.to(device))
        assert logits.dtype == torch.float16
    loss = torch.nn.functional.cross_entropy(logits.float(), labels.to(device))
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    losses.append(loss.item())
report(losses, model)
