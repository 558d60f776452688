"""The process's default client and session, created on the first remote tensor."""

from __future__ import annotations

import atexit
import gc
import threading
from typing import Any

_lock = threading.Lock()
_client: Any = None
_session: Any = None
# current_device_type(start=True) could not open one: it does not try again (an appliance
# that accepts but never answers would hold every attention call for an I/O timeout);
# the next default_session() that succeeds, or reset(), clears it
_start_failed = False
_frozen = False  # Note [frozen program]: done (or ruled out) for this process


def _freeze_program() -> None:
    """Note [frozen program]: Python's collector tracks every container object, and its
    full pass runs once the objects promoted to the oldest generation since the last one
    reach a quarter of those already there. Capture makes and keeps many (nodes, their
    argument lists, LazyTensors live until their graph is sent), so in a training loop a
    full pass came every ~20 steps and walked the program's 350,000 import-time objects
    each time: 150 ms, 8 ms a step of a 45 ms step (``gc.callbacks``, a 2-layer encoder).
    When its first default session opens, the client moves what exists then (modules, the
    model) to the generation the collector never walks (``gc.freeze``, as the worker does
    with its imports, Note [frozen imports]); every object made later is collected as
    before. What this gives up: a reference cycle among the frozen objects that becomes
    garbage later is never collected (freed at exit). ``client_gc_freeze = false`` leaves
    the collector as it is. Once per process."""
    global _frozen
    if _frozen:
        return
    _frozen = True
    from djinn import config

    if config.load().client_gc_freeze:
        gc.freeze()


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
        _freeze_program()
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
