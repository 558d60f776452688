"""Ctrl-C while a program waits for a graph's result (Note [interrupted waits], in
djinn/runtime/channel.py, has the channel's half).

Eager PyTorch finishes the op a Ctrl-C came in, and the KeyboardInterrupt is raised after
it: the tensors it made are there for the program that catches it (to save a model, say).
A captured graph read with ``.item()`` or ``.cpu()`` is that op here, and so is a graph in
flight that a read lands. So while a reply is awaited and landed, a first Ctrl-C is held
and raised once every node it ran is executed (or failed, and the rest of a partial graph
sent again). A second one is raised at once: the connection closes (the channel's half of
the Note) and what the graph made holds an ``Interrupted`` error (its result was never
read; the appliance may have run it). Before, the first Ctrl-C lost the reply, and every
value of that graph read "captured in another trace that was not run" (INTERNAL).

Only where Python's own SIGINT handler is in place, on the main thread (the only one a
signal handler can be set from, and the one SIGINT interrupts): a program with its own
handler keeps it.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

from djinn.errors import Interrupted


class _Held:
    def __init__(self) -> None:
        self.hit = False

    def __call__(self, signum: int, frame: Any) -> None:
        if self.hit:  # the second: now
            raise KeyboardInterrupt
        self.hit = True


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """A first Ctrl-C during the block is raised as it ends."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield  # another thread, a program's own handler, or one already held
        return
    hold = _Held()
    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if hold.hit:  # over an error the block raised too: its context
            raise KeyboardInterrupt


def unread() -> Interrupted:
    """What a graph whose result was never read holds."""
    return Interrupted(
        "its result was not read: the program was interrupted twice while it waited "
        "(the appliance may have run it)"
    )
