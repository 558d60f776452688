"""The scheduling-policy contract (DESIGN.md §10): what runs next on a worker.

A worker takes requests from every session it serves into one scheduler, and runs them
in slices: a graph yields between ops, so a long one can be set aside for a short one
and resumed with identical results. A policy only *chooses*: before every slice the
scheduler hands it a read-only view of the waiting and preempted requests and runs the
one it names. Ordering within a session, the slices, preemption and the accounting are
the appliance's, correct whichever policy chooses. Policies are plugins in the entry
point group ``djinn.schedulers``; Djinn instantiates one with no arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class WorkFacts:
    """One request as a policy sees it. Times are seconds."""

    key: int  # what ``choose`` returns to pick it
    session: str
    tenant: str  # who the session belongs to: "uid:N" (Unix peers) or "host:ADDR" (TCP)
    kind: str  # the request kind: EXEC, CALL, PUT, GET...
    method: str = ""  # model calls: forward, generate
    phase: str = "unknown"  # the client's hint for this call, else its session's last one
    nodes: int = 0  # EXEC: ops in the graph
    tokens: int = 0  # model calls: input positions (batch x sequence), 0 if not known
    batch: str = ""  # a decode step that can run batched with others of this key, else ""
    arrived_s: float = 0.0  # when it arrived, on the scheduler's clock
    waited_s: float = 0.0  # since it arrived
    ran_s: float = 0.0  # execution time it has had (a preempted graph)
    weight: float = 1.0  # its tenant's share weight (setting scheduler_weights)
    tenant_used_s: float = 0.0  # recent execution time of its tenant, divided by weight
    session_used_s: float = 0.0  # recent execution time of its session, divided by weight


@dataclass(frozen=True)
class SchedulingView:
    items: tuple[WorkFacts, ...]  # one per session with work: its oldest request
    running: int | None  # key of the request that ran the last slice, if it is unfinished
    small_graph_nodes: int  # setting scheduler_small_graph: a graph this small is interactive
    max_wait_s: float  # setting scheduler_max_wait_ms: nothing waits longer unless all do


@runtime_checkable
class SchedulerPolicy(Protocol):
    name: str

    def choose(self, view: SchedulingView) -> int:
        """The key of the request to run next. Must not raise; ``view.items`` is never
        empty."""

    # Optional: ``classify(facts, view) -> str``, the priority class a request has under
    # this policy, shown per session in the stats document and ``djinn top``.
