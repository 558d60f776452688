"""A CPU worker's intra-op threads, and the fewer a graph runs with while its client
captures beside it.

Note [a capturing client beside its worker]: a session on the unix socket is on this
host. A graph it sends without waiting for it (``"unwaited": true`` in the EXEC body:
Note [asynchronous flushes], Note [streamed graphs] in the frontend) runs while its
client goes on capturing the next graph, a Python thread that keeps one core busy. A
CPU worker whose OpenMP threads take every core then has one of them share a core with
that client, and every parallel region ends only when that descheduled thread gets its
time slice: on a 2-core host a training loop took 0.98 s with two threads and 0.70-0.78
s with one (``benchmarks/training_step.py``). So, with ``cpu_threads_beside_client``,
such a graph runs with one thread fewer than the worker has; a graph its client waits
for runs with all of them, and so does every other request. Its results are then local
eager's at that thread count, bit for bit (a reduction split over two threads rounds
otherwise).

The count follows the graph as sent, never the moment: a graph the lineage journal
replays after a lost worker (its body as sent, ``unwaited`` included) gets the numbers
it had the first time. (Switching to every thread once the client stops capturing and
waits would give the rest of a graph other rounding depending on when it did.) Which
graphs go unwaited follows what the program reads, though: a ``loss.item()`` before
``backward()`` makes the forward a waited graph, so a log line moves the numbers by a
rounding; and with several threads capturing, whether a graph is first read from
another thread (and so sent unwaited) can depend on timing.

So it is off by default: a training step's numbers would be those of local eager at
one thread fewer, not those of the same script on this machine's CPU, which ``djinn
run`` promises (a 20-step Adam loop ends 1.1e-4 away, as local eager does with one
thread fewer). On a GPU worker it does nothing: the kernels are not on the host's
cores. The count is set before each of the graph's ops and put back after it, since
the scheduler may run another request's op in between (``torch.set_num_threads``:
about 0.2 µs).
"""

from __future__ import annotations

import torch

beside_client = False  # the worker's cpu_threads_beside_client setting
_base = 0  # the worker's own count; 0 until known
_now = 0  # the count last set here; 0: not set here yet


def base() -> int:
    """The worker's own intra-op thread count (``cpu_threads``, else torch's default)."""
    global _base
    if not _base:
        _base = torch.get_num_threads()
    return _base


def configure(n: int) -> None:
    """The worker's own count, ``cpu_threads`` when it is set, at start-up."""
    global _base, _now
    torch.set_num_threads(n)
    _base = _now = n


def use(n: int) -> None:
    global _now
    if n != _now:
        torch.set_num_threads(n)
        _now = n


def for_graph(device: str, same_host: bool, unwaited: bool) -> int | None:
    """The threads a graph's ops run with when fewer than the worker's own, else None: a
    CPU worker's graph whose client sent it from this host without waiting for it."""
    n = base()
    if not beside_client or device != "cpu" or not same_host or not unwaited:
        return None
    return n - 1 if n > 1 else None
