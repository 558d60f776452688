"""Ctrl-C while a program waits for a graph's result (Note [interrupted waits], in
djinn/runtime/channel.py, has the channel's half).

Eager PyTorch finishes the op a Ctrl-C came in, and the KeyboardInterrupt is raised after
it: the tensors it made are there for the program that catches it (to save a model, say).
A captured graph read with ``.item()`` or ``.cpu()`` is that op here, and so is a graph in
flight that a read lands, or one being sent. So while a graph is sent, or its reply
awaited and landed, a first Ctrl-C is held and raised once every node it ran is executed
(or failed, and the rest of a partial graph sent again). A second one is raised at once:
the connection closes (the channel's half of the Note) and what the graph made holds an
``Interrupted`` error (its result was never read; the appliance may have run it). Before,
the first Ctrl-C lost the reply, and every value of that graph read "captured in another
trace that was not run" (INTERNAL).

How: the outermost ``deferred`` block on the main thread puts ``_on_sigint`` in the place
of Python's own handler for as long as it lasts (a program with a handler of its own keeps
it, and nothing is held). Outside the blocks Python's own is back: ``asyncio.run`` and
``unittest`` put theirs in only where they find it. A nested block costs a counter; the
outermost, two ``sigaction`` calls (``python -m timeit``: about 9 µs on this 2-core VM,
where a ``contextlib`` version with ``getsignal`` took 15 µs).
"""

from __future__ import annotations

import signal
import threading
from typing import Any

from djinn.errors import DjinnError, Interrupted

_MAIN = threading.main_thread().ident
_depth = 0  # deferred blocks open on the main thread
_hit = False  # a Ctrl-C came in them
_held = False  # _on_sigint is in place for them


def _on_sigint(signum: int, frame: Any) -> None:
    global _hit
    if not _hit:
        _hit = True
        return
    raise KeyboardInterrupt  # the second: now


class _Deferred:
    """``with deferred():`` a first Ctrl-C in the block is raised as it ends (over an
    error the block raised too: its context)."""

    __slots__ = ()

    def __enter__(self) -> None:
        global _depth, _hit, _held
        if threading.get_ident() != _MAIN:
            return
        if not _depth:
            _hit = False
            before = signal.signal(signal.SIGINT, _on_sigint)
            _held = before is signal.default_int_handler
            if not _held:  # the program's own, or ignored: kept
                signal.signal(signal.SIGINT, before)
        _depth += 1

    def __exit__(self, *exc: Any) -> None:
        global _depth, _hit
        if threading.get_ident() != _MAIN:
            return
        _depth -= 1
        if not _depth and _held:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            if _hit:
                _hit = False
                raise KeyboardInterrupt


_DEFERRED = _Deferred()


def deferred() -> _Deferred:
    return _DEFERRED


def why(exc: BaseException) -> DjinnError:
    """What the nodes of a graph hold when its request failed with ``exc``: its error, or
    for a second Ctrl-C, that its result was never read."""
    if isinstance(exc, DjinnError):
        return exc
    return Interrupted(
        "its result was not read: the program was interrupted twice while it waited "
        "(the appliance may have run it)"
    )
