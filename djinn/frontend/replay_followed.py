"""A replay whose optimizer steps are followed (Note [followed steps], replay_follow.py):
the two ways its graphs go, and which one a session takes.

Note [steps followed while the graph runs]: a followed replay sends the ops before the
steps (the split replay) as the call starts, so that the worker runs the forward and the
backward while the client follows the steps, and then the steps' own graph
(``Plan.steps``) with this call's floats, once the split's reply names the gradients
they read. On a GPU the split's floats do not change from call to call, so its plan can
be a CUDA graph (the whole recording's, whose bias corrections change, never can).

Where the worker's intra-op threads take every core of the client's host, that overlap
costs more than it gains: while the client follows, one of the worker's threads shares a
core with it, and every parallel region of the forward and backward waits for it. On a
2-core host, ``python benchmarks/followed_steps.py`` (a CPU worker of two threads, medians
of 5 rounds): a followed default-Adam step took 11.59 ms sent ahead against 10.01 ms with
the whole recording sent after the following (local eager 4.52 ms); with
``--worker-threads 1`` (3 rounds of 40 steps), 6.47 ms ahead against 6.91 ms after. So
such a session sends the whole recording as one replay after the following, as before:
the steps' floats in the whole template. ``overlapped`` decides, from the
``follow_ahead`` setting and, by default (``auto``), from what the worker said of its
device and threads when the session opened. On a GPU ahead wins: on an H100,
``replay_profile.py --workload adam`` took 3.82 ms a step ahead against 9.72 ms after (the
split replayed as a CUDA graph while the client follows).
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree

from djinn.errors import DjinnError
from djinn.protocol import templates
from djinn.runtime.remote import RemoteTensor

from . import failures, inflight, writes
from . import trace as trace_mod
from .nodes import Pending, Replayed
from .replay_follow import Follower
from .replay_outputs import bind_outputs, clear_grads, replay_body, replay_sent

if TYPE_CHECKING:
    from .replay_record import Record


def overlapped(session: Any) -> bool:
    """Whether ``session``'s followed replays send the split replay first (the Note): the
    ``follow_ahead`` setting; ``auto``, where its worker is not a CPU worker, or runs a
    graph sent without waiting with fewer threads than this host has cores."""
    return _ahead(session, "follow_ahead")


def replays_ahead(session: Any) -> bool:
    """Whether ``session``'s replays are sent behind the graph in flight (Note [replays
    sent ahead] in djinn/runtime/flights.py): the ``replay_ahead`` setting, ``auto`` as
    ``overlapped``'s (measured the same way: ``benchmarks/replay_ahead.py``)."""
    return _ahead(session, "replay_ahead")


def _ahead(session: Any, which: str) -> bool:
    client = vars(session).get("client")
    setting = getattr(client, which, "auto")
    if setting != "auto":
        return setting == "always"
    device = str(vars(session).get("device", "")).partition(":")[0]
    if device != "cpu":
        return bool(device)
    threads = vars(session).get("cpu_threads")
    return isinstance(threads, int) and threads < _cores()


@functools.cache
def _cores() -> int:
    """The cores this process may run on (its affinity, which a container's cpuset
    narrows), read once."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def followed(
    rec: Record,
    tr: Any,
    called: tuple[str, Any],
    tensors: list[Any],
    written: list[Any],
    split: list[RemoteTensor],
    inputs: list[RemoteTensor],
    optimizers: list[Any],
    behind: Any = None,
) -> Any:
    """Replay ``rec`` with its steps followed, the split replay sent first or the whole
    recording after (the Note); if the steps part from their plan, they are captured.
    ``split``, ``inputs``: the split replay's and the whole recording's input RemoteTensors;
    ``behind``: the flight its first graph goes behind (Note [replays sent ahead])."""
    from .session import default_session

    label, stats = called
    plan = rec.plan
    ahead = plan.steps is not None and overlapped(default_session())
    if ahead:  # the ops before the steps go now
        node, leaves = replay_sent(rec, tr, label, tensors, written, split, ahead=behind)
        clear_grads(rec)
        stop = None
    else:
        node, leaves, stop = _whole_bound(rec, tr, label, tensors, written, split, behind)
    follower = Follower(plan, tr, node, inputs, stop, ahead)
    follower.start()
    try:
        for opt in optimizers:
            opt.step()
    except BaseException:
        follower.abort("a step raised")
        if stats is not None:
            stats.captured[follower.why] += 1
        if ahead and node.failed is not None:
            # the split failed, landed by another thread: the capture of the ops followed
            # so far raised its error from the step. Its step counts went on; what it
            # writes must hold the error (a review: parameters 8e-4 off eager, silently,
            # in a loop that caught the error and went on)
            _steps_failed(rec, tr, label, tensors, follower, node.failed)
        raise
    if ahead:
        sent = _steps_sent(rec, tr, label, node, (tensors, inputs), follower)
    else:
        sent = _whole_sent(rec, tr, node, inputs, follower, behind)
    if sent:
        if stats is not None:
            stats.followed += 1
    else:
        if stats is not None:
            stats.captured[follower.why] += 1
        if follower.replaced:  # its steps read other tensors than recorded: stop trying
            rec.plan = rec.whole = None
        trace_mod.flush(tr, wait=False)
    return pytree.tree_unflatten(leaves, rec.out_spec)


def _steps_sent(
    rec: Record, tr: Any, label: str, alone: Any, called: tuple[list, list], follower: Follower
) -> bool:
    """Send the followed steps' graph after ``alone``, whose kept gradients it reads:
    False, the steps captured instead, if they were not all followed. If ``alone``
    failed, the steps are not sent, and what they write holds its error (Note [failed
    values]), as if they had run and failed on its gradients."""
    whole, steps = rec.whole, rec.plan.steps
    tensors, inputs = called
    raised = None
    try:
        if alone.inflight is not None:  # the gradients' handles; meanwhile the steps were
            # followed. Everything up to it lands, in order: it may have gone behind the
            # last call's steps (Note [replays sent ahead]), whose failure is the one to
            # raise here, once (landed alone, it failed it quietly, and that one's own
            # error came later, from whatever next waited: a review)
            inflight.land_all()
    except DjinnError as exc:  # the request failed: raised here, after what follows
        raised = exc
    except BaseException:
        follower.abort("its call was interrupted")
        raise
    error = raised or alone.failed
    if error is not None:
        # not captured either: the gradients they read hold the error. What the steps
        # write holds it too (an Adam whose CPU step counts went on must not go on from
        # moments that did not)
        follower.drop("the ops before its steps failed")
        _steps_failed(rec, tr, label, tensors, follower, error)
        if raised is not None:
            raise raised
        return True
    results = alone.results or []
    if any(kind == "keep" and (k >= len(results) or results[k] is None) for kind, k in steps.ins):
        follower.abort("a gradient its steps read was not kept")
    if not follower.finish():
        return False
    node = Replayed(f"the steps of {label}", tr, len(steps.tpl["keep"]),
                    _writes(whole, tensors))  # fmt: skip
    ins = [inputs[k] if kind == "in" else results[k] for kind, k in steps.ins]
    handles = [r.handle for r in ins]
    scalars = follower.floats
    body = templates.filled(steps.tpl, steps.fill, handles, scalars)
    with inflight.replay_in_flight(tr, node, body, [], (steps.fp, handles, scalars), ins):
        pass
    return True


def _steps_failed(
    rec: Record, tr: Any, label: str, tensors: list, follower: Follower, error: DjinnError
) -> None:
    """The steps did not run on the appliance: what they write, and any tensor they made
    that is still alive, hold ``error`` (Note [failed values])."""
    node = Replayed(f"the steps of {label}", tr, 0, _writes(rec.whole, tensors))
    failures.fail(node, error)
    failures.fail(follower.made, error)


def _writes(whole: Record, tensors: list) -> tuple[Any, ...]:
    """What the whole recording's steps write into, as refs (one dropped since holds no
    error)."""
    writes = [tensors[what] if kind == "arg" else what() for kind, what in whole.written]
    return tuple(t._ref for t in writes if t is not None)


def _whole_bound(
    rec: Record, tr: Any, label: str, tensors: list, written: list, split: list, behind: Any
) -> tuple[Replayed, list[Any], Any]:
    """The whole recording's node, not sent yet, with the outputs and gradients bound to
    it; and what sends ``rec`` instead, and binds them to it, if the following stops."""
    from .trace import bind

    whole, plan = rec.whole, rec.plan
    node = Replayed(f"a replay of {label}", tr, len(whole.tpl["keep"]),
                    _writes(whole, tensors))  # fmt: skip
    for t in written:  # the ops before the steps; the steps' own count as they are called
        torch.autograd.graph.increment_version(t)
        writes.forget_known(t)
    bound: list[tuple[Any, int]] = []
    leaves = bind_outputs(whole, node, tensors, bound)
    clear_grads(rec)

    def stop() -> None:  # the split replay, as it would have gone, and its outputs bound
        form, body = replay_body(rec, split)
        alone = Replayed(f"a replay of {label}", tr, body.keep, tuple(t._ref for t in written))
        with inflight.replay_in_flight(tr, alone, body, rec.inline_now(), form, split,
                                       ahead=behind):  # fmt: skip
            for t, k in bound:
                bind(t, Pending(alone, plan.slots[k]))

    return node, leaves, stop


def _whole_sent(
    rec: Record, tr: Any, node: Replayed, inputs: list, follower: Follower, behind: Any
) -> bool:
    """Send the whole recording with the steps' floats, if they were all followed."""
    if not follower.finish():
        return False
    whole = rec.whole
    handles = [r.handle for r in inputs]
    scalars = whole.scalars[: rec.plan.s_cut] + follower.floats
    if whole.fill is None:
        whole.fill = templates.instantiator(whole.tpl)
    body = templates.filled(whole.tpl, whole.fill, handles, scalars)
    with inflight.replay_in_flight(tr, node, body, whole.inline_now(),
                                   (whole.fingerprint, handles, scalars), inputs,
                                   ahead=behind):  # fmt: skip
        pass
    return True
