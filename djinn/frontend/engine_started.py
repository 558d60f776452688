"""Backward passes in a process whose autograd engine started before ``import djinn``.

Note [an engine started before Djinn]: PyTorch's autograd engine gives each device index
a ready queue and a thread. It sizes them once, the first time any backward pass runs,
from the device guards registered then (``Engine::start_device_threads``), and cannot
size them again. A program that ran a backward pass before it imported Djinn (a notebook
that trained on the CPU first; a script that imports Djinn in a function) has an engine
with no queue for the remote device, and each backward pass that reaches a remote tensor
stopped at PyTorch's internal assert ``device.index() < device_ready_queues_.size()``.

The engine can run a backward pass without any device queue: with
``torch.autograd.set_multithreading_enabled(False)`` (a thread's own setting) every node
runs on the calling thread, as a CPU node does anyway. The nodes and the order their
dependencies allow are the same, so are the values. So a remote tensor's ``backward()``
that meets that assert turns multithreading off for its thread, for good, and runs again,
and from then on ``backward()`` of a remote tensor on any thread runs with it off. A
thread with it off runs the remote nodes behind the same device guard as the engine's
device thread, so its hooks are guarded as that thread's are (Note [errors in hooks
during backward], hook_errors.py: a hook raising there aborted the process).

Running again is safe: the root (the remote tensor) is the first node the engine queues,
and the assert is raised by that lookup, before any node ran or any gradient was
accumulated. On a thread that has turned it off, ``torch.autograd.grad`` and
``torch.autograd.backward`` of remote tensors work too. Before a remote tensor's first
``backward()`` (or on another thread) they still meet PyTorch's assert: Djinn sees no call
of those before the engine runs it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# the assert's own words: the sign that the engine has no queue for the remote device
_ASSERT = "device_ready_queues_"

_started_before = False  # the engine was found started without the remote device


def backward(run: Callable[[], Any]) -> Any:
    """``run()``, a remote tensor's ``backward()``; on the calling thread when the engine
    started before Djinn (Note [an engine started before Djinn])."""
    global _started_before
    if _started_before:
        with torch.autograd.set_multithreading_enabled(False):  # puts back what it found
            return run()
    try:
        return run()
    except RuntimeError as exc:
        if _ASSERT not in str(exc):
            raise
    _started_before = True
    # for good on this thread: torch.autograd.grad of remote tensors here works too
    torch.autograd.set_multithreading_enabled(False)
    return run()
