"""Note [interrupted waits] (djinn/runtime/channel.py, djinn/frontend/interrupts.py): a
Ctrl-C while a program waits for a result is raised once the graph landed, as eager
raises it after the op it came in; a second one is raised at once, closing the
connection, and what that graph made holds an INTERRUPTED error; the next call rebuilds
the session from its journal and goes on. Each case runs in a process of its own: SIGINT
reaches a process's main thread, with Python's own handler, which a pytest worker may not
have. The signals are sent from inside the client's wait (its first ``_receive`` of an
EXEC's reply, or its first read of a frame's bytes), not by a timer: each lands where
the case says, every run.
"""

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
from djinn.frontend import trace
from djinn.runtime import channel
from djinn.transport import framing

R = "remote_accelerator:0"
mode = sys.argv[1]
real, real_fill = channel.Channel._receive, framing.FrameReader._fill
left = [0]


def ctrl_c():
    # the handler runs at the next bytecode, on this thread: the one SIGINT interrupts
    while left[0] and threading.current_thread() is threading.main_thread():
        left[0] -= 1
        os.kill(os.getpid(), signal.SIGINT)


def receive(self, kind, rid, sink):  # as the program starts to wait for a reply
    if kind == (Kind.PUT if mode == "put" else Kind.EXEC) and mode != "midframe":
        ctrl_c()
    return real(self, kind, rid, sink)


def fill(self, *args):  # right after bytes of a frame were taken from the socket
    got = real_fill(self, *args)
    if mode == "midframe":
        ctrl_c()
    return got


def encode(self, n):  # as a flush encodes the nodes it took from the trace
    if mode == "encoding":
        ctrl_c()
    return real_node(self, n)


real_node = trace._Encoder.node
channel.Channel._receive = receive
framing.FrameReader._fill = fill
trace._Encoder.node = encode
# as in a program started from a terminal: one started in the background by a shell
# without job control (a CI runner's) inherits SIGINT ignored, and Python then leaves it so
signal.signal(signal.SIGINT, signal.default_int_handler)
torch.manual_seed(0)
a = torch.randn(48, 48)
local = a
for _ in range(12):
    local = torch.tanh(local @ a / 8)
r = a.to(R)
if mode == "partial":  # a node of the graph fails on the worker; one after it does not
    bad = r[torch.tensor([100]).to(R)]
    c = r * 3
    left[0] = 1
    try:
        c.sum().item()
    except KeyboardInterrupt:  # raised once the rest of the graph was sent again and ran
        print("interrupted")
    print("c", torch.equal(c.cpu(), a * 3))
    try:
        bad.cpu()
    except DjinnError as exc:
        print("bad", exc.code)
    sys.exit(0)
if mode == "put":  # a put sent without waiting, landed by a call that holds no Ctrl-C
    x = a.to(R)
    left[0] = 1
    try:
        torch.remote_accelerator.memory_allocated()
    except KeyboardInterrupt:  # the connection closed: the put is made again by the rebuild
        print("interrupted")
    print("x", torch.equal(x.cpu(), a))
if mode.startswith("flight"):  # the graph is a replay in flight: its landing is interrupted
    step = djinn.replayable(lambda x, w: torch.tanh(x @ w / 8))
    b = r
    for _ in range(12):
        b = step(b, r)
else:
    b = r
    for _ in range(12):
        b = torch.tanh(b @ r / 8)
left[0] = 1 if mode in ("once", "flight", "encoding") else 0 if mode == "put" else 2
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
from djinn.frontend.session import default_session
print("recoveries", default_session().recovery_stats().get("recoveries"))
"""


@pytest.mark.parametrize(
    ("mode", "want"),
    [
        ("once", ["interrupted", "b True", "next True", "recoveries 0"]),  # b is there
        ("partial", ["interrupted", "c True", "bad EXECUTION_ERROR", ""]),  # a review's
        # while the flush encodes the nodes it took (it may land another thread's graph)
        ("encoding", ["interrupted", "b True", "next True", "recoveries 0"]),
        ("flight", ["interrupted", "b True", "next True", "recoveries 0"]),  # a replay's
        # twice while a replay lands: it is sent again on the rebuilt session (a review's
        # PROTOCOL_ERROR "no reply awaited": it had been taken from the awaited list)
        ("flight2", ["interrupted", "b True", "next True", "recoveries 1"]),
        ("twice", ["interrupted", "b INTERRUPTED", "next True", "recoveries 1"]),
        # the second while the reply's bytes are read: the stream is left closed, never
        # read from the middle of a frame (a review's SIGINT in a 32 MiB reply)
        ("midframe", ["interrupted", "b INTERRUPTED", "next True", "recoveries 1"]),
        # a review's: the put failed (PROTOCOL_ERROR), and read NOT_FOUND after the rebuild
        ("put", ["interrupted", "x True", "not interrupted", "b True"]),
    ],
)
def test_a_ctrl_c_while_a_result_is_awaited_keeps_the_session(appliance, tmp_path, mode, want):
    env = {**os.environ, "DJINN_ADDRESS": appliance.unix}
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True,
                         timeout=300, env=env, cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[:4] == want, (out.stdout, out.stderr[-3000:])
