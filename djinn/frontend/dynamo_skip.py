"""Keeping ``torch.compile`` out of Djinn's own Python (Note [dynamo skips djinn]).

Note [dynamo skips djinn]: dynamo cannot trace a remote tensor (it has no inside to
trace), so it breaks its graph at each op that takes one and runs the op as it is. That
op's ``__torch_dispatch__`` is Djinn's Python, and dynamo compiled it too, as it does any
frame called from a compiled region: the capture's own code (``stride()`` and
``storage_offset()`` of a remote tensor, the op's schema, the device checks) became nine
graphs, compiled at the first call and again at the second, and guarded at every call.
``python benchmarks/compiled_remote.py`` (a Linear + ReLU compiled right after its move)
read a first call of 8.1 s, a second of 248-341 ms, and later calls 1.5-2.0x the same
module's plain call; with Djinn's files skipped, 1.3 s, 4-6 ms, and 1.05x. So Djinn's
package is in dynamo's skip list (``trace_rules.SKIP_DIRS``, as numpy's is), and dynamo
runs its frames as plain Python.

Importing dynamo costs about 2 s, which ``import djinn`` must not pay: if it is not
loaded yet, the skip is added when its ``trace_rules`` module is (Note [on import],
on_import.py). A failure to add the skip (a torch whose ``trace_rules`` changed) never
fails the import. ``importlib.reload`` of ``trace_rules`` drops the skip (it rebuilds
``SKIP_DIRS``).
"""

from __future__ import annotations

import logging
from typing import Any

from .on_import import forget, when_loaded

log = logging.getLogger("djinn.frontend")

_RULES = "torch._dynamo.trace_rules"


def _skip(rules: Any) -> str | None:
    """Add Djinn's package to ``rules``' skip list; the directory added, to take out."""
    try:
        before = list(rules.SKIP_DIRS)
        rules.add("djinn")
        added = [d for d in rules.SKIP_DIRS if d not in before]
    except Exception:  # dynamo compiles Djinn's frames then, as before
        log.debug("djinn: could not add the package to dynamo's skip list", exc_info=True)
        return None
    return added[0] if added else None


def attach() -> Any:
    """Skip Djinn's files in dynamo, now or once dynamo is imported."""
    return when_loaded(_RULES, _skip)


def detach(state: Any) -> None:
    """Undo ``attach``: the finder taken out, or the directory out of the skip list."""
    rules, added = forget(state)
    if rules is not None and added is not None and added in rules.SKIP_DIRS:
        rules.SKIP_DIRS.remove(added)
        rules._recompile_re()
