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
loaded yet, a finder on ``sys.meta_path`` waits for its ``trace_rules`` module, adds
the skip once that module has run, and takes itself out.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any

_RULES = "torch._dynamo.trace_rules"


def _skip(rules: Any) -> str | None:
    """Add Djinn's package to ``rules``' skip list; the directory added, to take out."""
    before = list(rules.SKIP_DIRS)
    rules.add("djinn")
    added = [d for d in rules.SKIP_DIRS if d not in before]
    return added[0] if added else None


class _WhenLoaded(importlib.abc.MetaPathFinder):
    """Finds nothing itself: hands ``trace_rules`` to the usual finders, and adds the
    skip once the module has run."""

    def __init__(self) -> None:
        self.added: str | None = None

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != _RULES:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)  # once; and the lookup below must not find us
        spec = importlib.util.find_spec(name)
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            self.added = _skip(module)

        loader.exec_module = exec_module  # this spec's own loader object
        return spec


def attach() -> Any:
    """Skip Djinn's files in dynamo, now or once dynamo is imported."""
    rules = sys.modules.get(_RULES)
    if rules is not None:
        return (rules, _skip(rules))
    finder = _WhenLoaded()
    sys.meta_path.insert(0, finder)
    return finder


def detach(state: Any) -> None:
    """Undo ``attach``: the finder taken out, or the directory out of the skip list."""
    if isinstance(state, _WhenLoaded):
        if state in sys.meta_path:
            sys.meta_path.remove(state)
            return
        rules, added = sys.modules.get(_RULES), state.added
    else:
        rules, added = state
    if rules is not None and added is not None and added in rules.SKIP_DIRS:
        rules.SKIP_DIRS.remove(added)
        rules._recompile_re()
