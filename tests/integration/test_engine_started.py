"""Note [an engine started before Djinn] (djinn/frontend/engine_started.py): a process that
ran a backward pass before ``import djinn`` trains on the remote device with local eager's
bits. The autograd engine is process-wide, so each case runs in a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys

# A CPU backward pass first (the engine sizes its device queues then), then Djinn: a
# training loop captured op by op and the same loop replayed, torch.autograd.grad, and a
# backward() on another thread, each against the same computation on the CPU.
SCRIPT = """
import copy, threading
import torch
import torch.nn.functional as F

torch.manual_seed(0)
local = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
x, y = torch.randn(32, 8), torch.randn(32, 1)
F.mse_loss(local(x), y).backward()
local.zero_grad(set_to_none=True)

import djinn

R = "remote_accelerator:0"
start = copy.deepcopy(local)


def train(model, a, b, replay):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(a, b):
        opt.zero_grad()
        loss = F.mse_loss(model(a), b)
        loss.backward()
        opt.step()
        return loss.detach()

    run = djinn.replayable(step) if replay else step
    return [float(run(a, b)) for _ in range(6)], run


def same(model, reference):
    return all(torch.equal(p.detach().cpu(), q.detach())
               for p, q in zip(model.parameters(), reference.parameters(), strict=True))


want, _ = train(local, x, y, replay=False)
for replay in (False, True):
    model = copy.deepcopy(start).to(R)
    got, run = train(model, x.to(R), y.to(R), replay)
    assert got == want, (replay, got, want)
    assert same(model, local), replay
    print("trained", "replayed" if replay else "captured",
          run.stats()["replays"] if replay else "")

model, ref = copy.deepcopy(start).to(R), copy.deepcopy(start)
grads = torch.autograd.grad(F.mse_loss(model(x.to(R)), y.to(R)), list(model.parameters()))
want = torch.autograd.grad(F.mse_loss(ref(x), y), list(ref.parameters()))
assert all(torch.equal(g.cpu(), w) for g, w in zip(grads, want, strict=True))
print("grad")

model, ref = copy.deepcopy(start).to(R), copy.deepcopy(start)
thread = threading.Thread(target=lambda: F.mse_loss(model(x.to(R)), y.to(R)).backward())
thread.start()
thread.join()
F.mse_loss(ref(x), y).backward()
assert all(torch.equal(p.grad.cpu(), q.grad)
           for p, q in zip(model.parameters(), ref.parameters(), strict=True))
print("thread")

# a hook that raises: backward() raises it, as CPU eager does (it aborted the process
# when the nodes ran on this thread: Note [errors in hooks during backward])
model = copy.deepcopy(start).to(R)
out = model(x.to(R))
out.register_hook(lambda g: 1 / 0)
try:
    F.mse_loss(out, y.to(R)).backward()
except ZeroDivisionError:
    print("hook")
"""


def test_a_process_that_ran_backward_before_import_djinn_trains_remotely(appliance, tmp_path):
    env = {**os.environ, "DJINN_ADDRESS": appliance.unix}
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=300, env=env, cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.split("\n")
    want = ["trained captured ", "trained replayed 3", "grad", "thread", "hook"]
    assert lines[:5] == want, out.stdout
