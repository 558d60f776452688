"""The requests a worker answers without queueing them for its scheduler, and why."""

from __future__ import annotations

from djinn.protocol.frames import Kind

# Note [unscheduled heartbeats]: a HEARTBEAT or PING is answered as soon as it is read,
# not queued for the scheduler. It does no work (its reply is the session's byte count),
# so there is nothing to order, weigh or charge to a tenant, and its session has no other
# request in the scheduler (the loop reads no frame of a session that has one). The
# scheduler's submit, choice and accounting were a third of the worker's CPU time for a
# heartbeat (benchmarks/transport.py's protocol floor).
UNSCHEDULED = frozenset({Kind.HEARTBEAT, Kind.PING})
# Note [immediate requests]: a request that moves bytes and runs no op (a put, a get, a
# free, a slab lease) runs to its end in one slice however it is scheduled: its handler
# never yields. So when the scheduler holds no other request there is nothing to order it
# against, and it runs as soon as it is read, charged to its tenant and session as the
# one slice it would have been (Scheduler.ran_alone). Queueing it cost the worker about 6
# µs of a 35 µs tiny GET (submit, facts, choice, generator, accounting). With anything
# queued it queues too: the policy orders it with the rest. One per visit to a session's
# socket: the requests a client streams without waiting behind it go to the scheduler,
# or that client would hold the worker for its whole stream (a review measured another
# session's heartbeat waiting 130 ms behind 3,000 pipelined GETs).
IMMEDIATE = frozenset({Kind.PUT, Kind.GET, Kind.FREE, Kind.ALLOC})
