"""Running code on a torch module when it is imported, without importing it
(Note [on import]).

Note [on import]: dynamo and inductor cost seconds to import, which ``import djinn``
must not pay, yet Djinn must adjust them once they are loaded (Note [dynamo skips
djinn], Note [torch.compile and remote values]). ``when_loaded(name, action)`` runs
``action`` on the module at once if it is loaded; else a finder on ``sys.meta_path``
waits for it and hands it back with a loader of its own, which runs the usual one and
then the action. The finder stays in the list, spent, until ``forget``: taking it out
from inside ``find_spec`` could make another thread's import, looping over the list,
miss the finder after it. The usual loader is wrapped, not patched: zipimport's and
frozen applications' loaders serve many modules with one object, and a review's patched
one ran the skip on every dynamo module after ``trace_rules`` (dynamo could no longer be
imported).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from typing import Any


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
    after that."""

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
