"""Import the model code a worker will need before the first registration needs it.

Note [prewarm]: the first REGISTER of a transformers model on a fresh worker spent 5.1 of
its 6.3 s importing transformers' shared modules (activations, kernels, weight
conversion) before building the model: cold imports, paid once per worker process but
paid by a user, and again after every worker restart. A ready worker therefore imports
them in a background thread while it waits for work. Python's import lock makes a
registration that arrives meanwhile wait for the same import rather than race it, and
an import that fails (transformers absent) only means the registration pays as before.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time

log = logging.getLogger("djinn.appliance.prewarm")

# imported by every transformers model class's module: the bulk of a cold registration
TRANSFORMERS = ("transformers.modeling_utils", "transformers.activations")


def modules_for(allowlist: list[str]) -> tuple[str, ...]:
    allowed = any(p.rstrip(".") == "transformers" for p in allowlist)
    return TRANSFORMERS if allowed else ()


class Prewarm:
    """The background import; ``state`` is what the stats document shows: off, running,
    done or failed (benchmarks wait for done before they measure a warm worker)."""

    def __init__(self, modules: tuple[str, ...]) -> None:
        self.modules = modules
        self.state = "off" if not modules else "pending"

    def start(self) -> None:
        if self.modules:
            self.state = "running"
            threading.Thread(target=self._run, name="djinn-prewarm", daemon=True).start()

    def _run(self) -> None:
        started = time.perf_counter()
        for name in self.modules:
            try:
                importlib.import_module(name)
            except Exception as exc:  # a registration that needs it will say what is wrong
                log.info("prewarm: could not import %s: %s", name, exc)
                self.state = "failed"
                return
        self.state = "done"
        took = time.perf_counter() - started
        log.info("prewarm: imported %s in %.1fs", ", ".join(self.modules), took)
