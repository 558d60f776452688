"""The process's default client and session, created on the first remote tensor."""

from __future__ import annotations

import atexit
import gc
import os
import threading
from typing import Any

_lock = threading.Lock()
_client: Any = None
_session: Any = None
# current_device_type(start=True) could not open one: it does not try again (an appliance
# that accepts but never answers would hold every attention call for an I/O timeout);
# the next default_session() that succeeds, or reset(), clears it
_start_failed = False
_paced = False  # Note [collector pace]: done (or ruled out) for this process
_forked = False  # forked from a process that held a default session: Note [a forked process]


def _after_fork_in_child() -> None:
    """Note [a forked process] (djinn/runtime/channel.py): the parent's session is not
    this process's. Forgotten unclosed (closing would speak on the parent's connection);
    its channel refuses every request, and so does a new default session here, as CUDA
    refuses a forked child that its parent had initialised."""
    global _client, _session, _forked
    if _client is not None or _session is not None:
        _forked = True
    _client = _session = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _pace_collector() -> None:
    """Note [collector pace]: Python's collector runs a young collection every
    ``threshold0`` (700 in CPython 3.11) container objects made and not yet freed, and a
    full one once the objects promoted to the oldest generation since the last reach a
    quarter of those already there. Capture makes many and keeps them until their graph is
    sent (nodes, argument lists, LazyTensors), so young collections found them alive and
    promoted them: in a small training loop a full collection came every ~20 steps and
    walked the program's 350,000 objects, 150 ms each, 7.6 ms a step of 45 (measured with
    ``gc.callbacks``). When the client's first default session opens it raises
    ``threshold0`` to ``client_gc_threshold`` (10,000; never lowers one the program set):
    most capture objects are freed before a young collection sees them, and full
    collections became rare (none in 60 steps). Nothing is exempted from collection:
    cyclic garbage waits a little longer for a young pass (as with CPython 3.12's 2,000).
    (Freezing the program's objects out of the collector, ``gc.freeze``, was as fast but
    kept whatever hung off a frozen cycle: a model with a bound-method hook moved to the
    appliance kept its remote weights after ``del``, and a replaced session its journal.)
    Once per process."""
    global _paced
    if _paced:
        return
    _paced = True
    from djinn import config

    wanted = config.load().client_gc_threshold
    now = gc.get_threshold()
    if wanted > now[0]:
        gc.set_threshold(wanted, *now[1:])


def default_session() -> Any:
    """The session remote tensors use. Note [session after loss]: a session whose worker
    or appliance went away, or that the appliance ended (an operator) or expired, is
    replaced for new work: tensors it held keep raising their typed error (SESSION_LOST,
    SESSION_ENDED...), but the program's next tensors go to a new session, on a new
    connection if the appliance itself restarted, instead of failing forever. A lost
    session is first rebuilt where it can be (Note [lineage journal] in
    djinn/runtime/lineage.py): it is replaced only once its recovery gave up."""
    global _client, _session, _start_failed
    session = _session
    if session is not None and session.usable:
        return session
    if _forked:
        from djinn.errors import UnsupportedOp
        from djinn.runtime.channel import FORKED

        raise UnsupportedOp(FORKED)
    with _lock:
        if _session is None or not _session.usable:
            from djinn.errors import DjinnError
            from djinn.runtime.client import connect

            if _session is not None:
                _session.close()
            if _client is None:
                _client = connect()
                atexit.register(_close)
            recover = _recovering()
            try:
                _session = _client.session(recover=recover)
            except DjinnError:  # the connection is gone too: the appliance restarted
                _client.close()
                _client = connect()
                _session = _client.session(recover=recover)
        _start_failed = False
        _pace_collector()
        return _session


def current_device_type(start: bool = False) -> str | None:
    """The device type (``cpu``, ``cuda``) of the default session's worker, or None when
    there is no usable default session yet. With ``start``, the default session is opened
    if there is none (a program's first capture may come before any request); one that
    cannot be opened is None here and raises its typed error where it is used."""
    global _start_failed
    session = _session
    if start and not _start_failed and (session is None or not session.usable):
        from djinn.errors import DjinnError

        try:
            session = default_session()
        except DjinnError:
            _start_failed = True  # its error is raised where the session is used
            return None
    if session is None or not session.usable:
        return None
    # from the instance: a fleet session not placed yet has no device, and reading the
    # attribute would place it (Note [lazy placement]) in the middle of a dispatch
    return str(vars(session).get("device", "")).partition(":")[0] or None


def _recovering() -> bool:
    """Note [lineage journal]: the default session is rebuilt after a worker is lost
    unless ``recovery_retries`` is 0."""
    from djinn import config

    return config.load().recovery_retries > 0


def _close() -> None:
    global _session, _client, _start_failed
    _start_failed = False
    if _session is not None:
        _session.close()
    if _client is not None:
        _client.close()
    _session = _client = None


def reset() -> None:
    """Forget the default session (tests; after the appliance restarted)."""
    _close()
