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
loaded yet, a finder on ``sys.meta_path`` waits for its ``trace_rules`` module and hands
it back with a loader of its own, which runs the usual one and then adds the skip. The
finder stays in the list, spent, until ``detach``: taking it out from inside
``find_spec`` could make another thread's import, looping over the list, miss the finder
after it. The usual loader is wrapped, not patched: zipimport's and frozen applications'
loaders serve many modules with one object, and a review's patched one ran the skip on
every dynamo module after ``trace_rules`` (dynamo could no longer be imported). A
failure to add the skip (a torch whose ``trace_rules`` changed) never fails the import.
``importlib.reload`` of ``trace_rules`` drops the skip (it rebuilds ``SKIP_DIRS``).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import sys
from collections.abc import Callable
from typing import Any

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


class _Then(importlib.abc.Loader):
    """A module's usual loader, then the finder's action on the module; anything else is
    the usual one's."""

    def __init__(self, loader: Any, finder: WhenLoaded) -> None:
        self._loader = loader
        self._finder = finder

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        self._finder.added = self._finder.action(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename...
        return getattr(self._loader, name)


class WhenLoaded(importlib.abc.MetaPathFinder):
    """Finds nothing itself: hands module ``name`` to the usual finders, with a loader
    that runs ``action`` on it once it has run (what it returns is ``added``); spent
    after that. Also what inductor_remote.py waits for inductor with."""

    def __init__(self, name: str, action: Callable[[Any], Any]) -> None:
        self.name = name
        self.action = action
        self.added: Any = None
        self.spent = False

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != self.name or self.spent:
            return None
        self.spent = True  # and the lookup below must not come back here
        spec = importlib.util.find_spec(name)
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        spec.loader = _Then(loader, self)
        return spec


def when_loaded(name: str, action: Callable[[Any], Any]) -> Any:
    """``action(module)`` now if module ``name`` is loaded (its result, with the module),
    else a ``WhenLoaded`` finder, first on ``sys.meta_path``, that runs it on import."""
    module = sys.modules.get(name)
    if module is not None:
        return (module, action(module))
    finder = WhenLoaded(name, action)
    sys.meta_path.insert(0, finder)
    return finder


def forget(state: Any) -> tuple[Any, Any]:
    """Undo ``when_loaded``'s finder (taken out if still waiting); the module, if it was
    loaded, and what the action returned."""
    if isinstance(state, WhenLoaded):
        if state in sys.meta_path:
            sys.meta_path.remove(state)
        return sys.modules.get(state.name), state.added
    return state


def attach() -> Any:
    """Skip Djinn's files in dynamo, now or once dynamo is imported."""
    return when_loaded(_RULES, _skip)


def detach(state: Any) -> None:
    """Undo ``attach``: the finder taken out, or the directory out of the skip list."""
    rules, added = forget(state)
    if rules is not None and added is not None and added in rules.SKIP_DIRS:
        rules.SKIP_DIRS.remove(added)
        rules._recompile_re()
