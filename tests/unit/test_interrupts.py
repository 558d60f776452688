"""djinn/frontend/interrupts.py (Note [interrupted waits]): the hold of a first Ctrl-C
while a graph is sent or landed, in a process of its own (SIGINT reaches the main thread,
which a pytest worker's tests may not run on, and a CI runner may start it ignored)."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = r"""
import os, signal
from djinn.frontend import interrupts
from djinn.frontend.interrupts import deferred

def ctrl_c():
    os.kill(os.getpid(), signal.SIGINT)

signal.signal(signal.SIGINT, signal.default_int_handler)  # as a terminal starts it
try:  # held to the end of the outermost block, through a nested one
    with deferred():
        with deferred():
            ctrl_c()
        print("inner ended")
    print("not raised")
except KeyboardInterrupt:
    print("raised at the end")
print("python's own after", signal.getsignal(signal.SIGINT) is signal.default_int_handler)
try:  # the second is raised at once
    with deferred():
        ctrl_c()
        ctrl_c()
        print("not raised")
except KeyboardInterrupt:
    print("second at once")
try:  # over an error the block raised: the error is its context
    with deferred():
        ctrl_c()
        raise ValueError("the block's")
except KeyboardInterrupt as exc:
    print("over", type(exc.__context__).__name__)
with deferred():  # nothing came: nothing raised
    pass
print("quiet")
seen = []
signal.signal(signal.SIGINT, lambda *a: seen.append("own"))  # a program's own handler
with deferred():
    print("own kept", signal.getsignal(signal.SIGINT) is not interrupts._on_sigint)
    ctrl_c()
print("own called", seen)
"""


def test_a_first_ctrl_c_is_held_to_the_end_of_the_outermost_block():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[:9] == [
        "inner ended",
        "raised at the end",
        "python's own after True",
        "second at once",
        "over ValueError",
        "quiet",
        "own kept True",
        "own called ['own']",
        "",
    ], out.stdout
