"""The process's default client and session, created on the first remote tensor."""

from __future__ import annotations

import atexit
import threading
from typing import Any

_lock = threading.Lock()
_client: Any = None
_session: Any = None


def default_session() -> Any:
    global _client, _session
    session = _session
    if session is not None and not session._closed.is_set():
        return session
    with _lock:
        if _session is None or _session._closed.is_set():
            from djinn.runtime.client import connect

            if _client is None:
                _client = connect()
                atexit.register(_close)
            _session = _client.session()
        return _session


def _close() -> None:
    global _session, _client
    if _session is not None:
        _session.close()
    if _client is not None:
        _client.close()
    _session = _client = None


def reset() -> None:
    """Forget the default session (tests; after the appliance restarted)."""
    _close()
