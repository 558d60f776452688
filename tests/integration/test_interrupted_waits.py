"""Note [interrupted waits] (djinn/runtime/channel.py, djinn/frontend/interrupts.py): a
Ctrl-C while a program waits for a result is raised once the graph landed, as eager
raises it after the op it came in; a second one is raised at once, and what that graph
made holds an INTERRUPTED error; a reply still awaited is read before the next request's,
and the session goes on. Each case runs in a process of its own: SIGINT reaches a
process's main thread, with Python's own handler, which a pytest worker may not have."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import os, signal, sys, threading
import torch, djinn
from djinn.errors import DjinnError
from djinn.protocol.frames import Kind
from djinn.runtime import channel

R = "remote_accelerator:0"
mode = sys.argv[1]
real = channel.Channel._receive
left = [0]


def receive(self, kind, rid, sink):
    # Ctrl-C as the program starts to wait for an EXEC's reply (the handler runs at the
    # next bytecode, on this thread: the one SIGINT interrupts)
    while left[0] and kind == Kind.EXEC and threading.current_thread() is threading.main_thread():
        left[0] -= 1
        os.kill(os.getpid(), signal.SIGINT)
    return real(self, kind, rid, sink)


channel.Channel._receive = receive
torch.manual_seed(0)
a = torch.randn(48, 48)
local = a
for _ in range(12):
    local = torch.tanh(local @ a / 8)
r = a.to(R)
if mode == "flight":  # the graph is a replay in flight: its landing is interrupted
    step = djinn.replayable(lambda x, w: torch.tanh(x @ w / 8))
    b = r
    for _ in range(12):
        b = step(b, r)
else:
    b = r
    for _ in range(12):
        b = torch.tanh(b @ r / 8)
left[0] = 2 if mode == "twice" else 1
try:
    b.sum().item()
    print("not interrupted")
except KeyboardInterrupt:
    print("interrupted")
try:
    print("b", torch.allclose(b.cpu(), local, rtol=1e-5, atol=1e-5))
except DjinnError as exc:
    print("b", exc.code)
print("next", torch.equal((r[0, :4] * 2).cpu(), a[0, :4] * 2))
"""


@pytest.mark.parametrize(
    ("mode", "want"),
    [
        ("once", ["interrupted", "b True", "next True"]),  # raised after: b is there
        ("twice", ["interrupted", "b INTERRUPTED", "next True"]),
        ("flight", ["interrupted", "b True", "next True"]),  # landed by the next read
    ],
)
def test_a_ctrl_c_while_a_result_is_awaited_keeps_the_session(appliance, tmp_path, mode, want):
    env = {**os.environ, "DJINN_ADDRESS": appliance.unix}
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True,
                         timeout=300, env=env, cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[:3] == want, (out.stdout, out.stderr[-3000:])
