"""Built-in scheduling policies (entry point group ``djinn.schedulers``).

``semantic`` (the default) runs latency-critical work first and shares the rest fairly;
``fifo`` (arrival order, a started request runs to its end) is the comparison it must beat
in ``benchmarks/scheduling.py``.
"""

from __future__ import annotations

from djinn.semantics.scheduling import SchedulingView, WorkFacts

# Requests that are one bounded copy or lookup: never worth making anyone wait for.
QUICK_KINDS = frozenset({"HEARTBEAT", "PUT", "GET", "ALLOC", "FREE", "SESSION_CLOSE"})
# A model call over at most this many input positions is a decode step, not a prefill.
DECODE_TOKENS = 8
# A running throughput request keeps the device until its tenant is this far (seconds of
# weighted execution) ahead of the most deserving waiting one: slices of two long graphs
# interleaved op by op would hold both graphs' intermediate tensors at once.
QUANTUM_S = 0.05


class FifoScheduler:
    """Arrival order; a request that started runs to its end (what a worker did before
    it had a scheduler)."""

    name = "fifo"

    def choose(self, view: SchedulingView) -> int:
        if view.running is not None:
            return view.running
        return min(view.items, key=lambda w: w.arrived_s).key

    def classify(self, w: WorkFacts, view: SchedulingView) -> str:
        return "arrival"  # one class: first come, first served


class SemanticScheduler:
    """Note [semantic scheduling]: what the program is doing decides the order.

    1. Latency-critical first: decode steps (a model call with the decode phase hint, or
       a few input positions), small graphs (an interactive op, a sampling step) and the
       quick requests (puts, gets, heartbeats). Throughput work (prefills, ``generate``,
       long graphs such as a training step) runs when none waits, and is preempted at an
       op boundary when one arrives.
    2. Within a class, weighted fair shares: the request whose tenant, then session, has
       had the least recent execution time per unit of weight goes first, so two tenants
       with weights 2 and 1 get two thirds and one third of a busy worker.
    3. Ageing: a request waiting longer than ``max_wait_s`` joins the latency-critical
       class, so nothing starves however much interactive work arrives.
    A running throughput request is not switched for another throughput request until
    its tenant is ``QUANTUM_S`` ahead (memory: two half-run graphs hold both their
    intermediates).
    """

    name = "semantic"

    def choose(self, view: SchedulingView) -> int:
        ranked = sorted(view.items, key=lambda w: self._rank(w, view))
        best = ranked[0]
        running = next((w for w in view.items if w.key == view.running), None)
        if running is not None and running.key != best.key:
            same_class = self._class(running, view) == self._class(best, view)
            ahead = running.tenant_used_s - best.tenant_used_s
            if same_class and self._class(best, view) == 1 and ahead < QUANTUM_S:
                return running.key
        return best.key

    def classify(self, w: WorkFacts, view: SchedulingView) -> str:
        if w.waited_s > view.max_wait_s:
            return "aged"
        return "latency" if self._class(w, view) == 0 else "throughput"

    def _rank(self, w: WorkFacts, view: SchedulingView) -> tuple:
        return (self._class(w, view), w.tenant_used_s, w.session_used_s, w.arrived_s)

    @staticmethod
    def _class(w: WorkFacts, view: SchedulingView) -> int:
        """0: latency-critical (or aged), 1: throughput."""
        if w.waited_s > view.max_wait_s:
            return 0
        if w.kind in QUICK_KINDS:
            return 0
        if w.kind == "EXEC":
            return 0 if w.nodes <= view.small_graph_nodes else 1
        if w.kind == "CALL":
            if w.method == "generate" or w.phase == "prefill":
                return 1
            if w.phase == "decode" or 0 < w.tokens <= DECODE_TOKENS:
                return 0
            return 1
        return 1
