"""Optimizer steps that end a replayable call, run at every replay rather than replayed.

Note [optimizer steps run, not replayed]: an optimizer's step computes Python floats from
Python state (the default ``Adam``'s bias corrections, from a step count kept in a CPU
tensor it increments), and a replay runs no Python: it would freeze the floats and the
count, so such a call never records alike. When ``fn`` *ends* with optimizer steps
(every op from the first step's start on was captured by one of them, in turn, none
took a closure and all ran on the calling thread: PyTorch's global step hooks say where
each began and ended; Djinn's pre-hook goes first, so what any other hook captures is
part of the step; a step an optimizer runs inside its own, a subclass's ``step()``
calling ``super().step()``, is part of the outer one), a recording also keeps the record
of the ops before them. Once two
recordings in a row are unlike as wholes but alike before their steps, or as soon as
the call changed state its whole replay would be checked by (RMSprop's and Adagrad's
step counts, a count in a param group: a whole replay would freeze them), the key
replays that part and runs the steps after it, as ``fn`` would: a replay puts the
graph's gradients in ``.grad``, clears the ``.grad`` the call cleared, then calls each
optimizer's ``step()``, captured like any op with this step's floats, its hooks and its
state, and sends it without waiting; or, when the whole recordings were alike but for
their floats, follows the steps and sends the whole call as one graph (Note [followed
steps], replay_follow.py). What the optimizers keep is then left out of the
state check; their hyperparameters are not (``fn`` may read a learning rate before the
step: a new one records again). A call whose floats and counts stay the same (SGD,
``Adam(capturable=True)``) replays whole, which costs the client less.

What the call itself changes is seen against the key's last recording, as it was when
the call began (``Watch``, replay_key.py): state changed outside the steps (a
learning rate set, a scheduler stepped inside ``fn``) means no split, and with the whole
changed too, that recording does not count towards a replay (it is unlike the one
before; a change made once, as ``model.train()`` after an outside ``eval()``, is not
seen by the next); a ``.grad`` the call cleared (``zero_grad``) is cleared by each
replay, one it found and left None must be None when a replay begins (only where the
call writes into something, made gradients or stepped: a forward's results do not
depend on ``.grad``), and one it assigned (``p.grad = g``) means no replay. Those
parameters are held by where they are (a module's name, an optimizer's place), weakly.
So a call that writes, made gradients or stepped replays only from a recording that had
one before it: ``after=1`` replays such a call from its third call on. A call with none
of those replays from its second with ``after=1``, before any comparison: Python state
it changes itself (a train flag it flips) is then not seen.

A split is made only if a replay can give each step what it found: the steps read only
gradients still in ``.grad`` as the call ends, each stepped parameter's ``.grad`` is the
same at the end as when its step began, and that was None, one the call made and left
in ``.grad``, or one it did not make. A step followed by ``zero_grad()`` reads gradients
that are gone at the end, so such a call replays only whole.
"""

from __future__ import annotations

from typing import Any

import torch.utils._pytree as pytree

from .nodes import Pending
from .replay_key import Miss, Step, Watch, grad_cell


def outer_steps(steps: list[Step]) -> list[Step]:
    """The steps, less those an optimizer ran inside its own step (a subclass's ``step()``
    calling ``super().step()``: PyTorch's step hooks wrap both), which a replay runs by
    calling the outer one."""
    outer: list[Step] = []
    for step in steps:
        last = outer[-1] if outer else None
        if (
            last is not None
            and step.opt is last.opt
            and last.end is not None
            and step.end is not None
            and last.start <= step.start
            and step.end <= last.end
        ):
            continue
        outer.append(step)
    return outer


def optimizer_cut(count: int, steps: list[Step]) -> int | None:
    """Where the call's optimizer steps begin, when they end it: every op from there on
    was captured by one of them, in turn (Note [optimizer steps run, not replayed]).
    None when it has none, a step took arguments (a closure) or ran on another thread,
    or an op was captured between, after or around them."""
    if not steps or any(step.odd or step.end is None for step in steps):
        return None
    cut = end = steps[0].start
    for step in steps:
        if step.start != end:
            return None
        end = step.end
    return cut if 0 < cut < end == count else None


def steps_read_gradients(
    nodes: list[Any], cut: int, before: set[int], owners: dict[int, Any]
) -> bool:
    """Whether every value the ops from ``cut`` on (the optimizer steps) read of what the
    ops ``before`` made is a gradient still in ``.grad`` as the call ends: a replay puts
    those back in ``.grad`` before the steps run, and gives no other. (A step followed by
    ``zero_grad()`` read gradients that are gone at the end.)"""

    def in_grad(ref: Pending) -> bool:
        return any(
            (cell := w()) is not None and id(cell) in owners and _same_ref(cell.ref, ref)
            for w in ref.node.holders[ref.index]
        )

    return all(
        in_grad(ref)
        for n in nodes[cut:]
        for ref in pytree.tree_leaves((n.args, n.kwargs))
        if isinstance(ref, Pending) and id(ref.node) in before
    )


def _same_ref(a: Any, b: Any) -> bool:
    """The same value: one object, or two Pending refs of one output."""
    return a is b or (
        isinstance(a, Pending) and isinstance(b, Pending) and (a.node, a.index) == (b.node, b.index)
    )


def grads_left(watch: Watch | None, left: dict, effects: bool) -> tuple[list, list]:
    """Where the parameters are (``param_at``) whose ``.grad`` the call cleared, and those
    it found and left None if it has ``effects`` (a forward's results do not depend on
    ``.grad``); a Miss if it put there a tensor it did not make (``p.grad = g``: a replay
    could not). Known from a key's second recording on (``watch``)."""
    clears: list[Any] = []
    nones: list[Any] = []
    if watch is None:
        return clears, nones
    made = {id(owner) for owner, _spec in left.values()}
    for p, where, start in watch.grads.values():
        if id(p) in made:
            continue
        end = grad_cell(p)
        if end is None and start is not None:
            clears.append(where)
        elif end is None and effects:
            nones.append(where)
        elif end is not start:
            raise Miss("it puts in .grad a tensor it did not make")
    return clears, nones


def grads_as_at_steps(steps: list[Step]) -> bool:
    """Whether each stepped parameter's ``.grad`` is, as the call ends, what it was as its
    step began: a replay sets them all before the steps."""
    for step in steps:
        for p, ref in step.grads:
            cell = grad_cell(p)
            if not _same_ref(getattr(cell, "ref", cell), ref):
                return False
    return True


def steps_find_their_gradients(steps: list[Step], before: set[int], left: dict) -> bool:
    """Whether each parameter of the steps had, as its step began, no gradient (a replay
    sets None), one the ops before made and leave in its ``.grad`` (a replay sets it),
    or one the call did not make (a replay leaves it)."""
    for step in steps:
        for p, grad in step.grads:
            if isinstance(grad, Pending) and id(grad.node) in before:
                got = left.get((id(grad.node), grad.index))
                if got is None or got[0] is not p:
                    return False
    return True


def own_inline(nodes: list[Any], inline: list[Any]) -> tuple[list[Any], list[Any]]:
    """``nodes`` with their inline tensors numbered among themselves (they are a part of
    a graph), and those tensors."""
    mine: dict[int, int] = {}

    def walk(x: Any) -> Any:
        if isinstance(x, list):
            return [walk(v) for v in x]
        if isinstance(x, dict):
            if "$t" in x:
                return {**x, "$t": mine.setdefault(x["$t"], len(mine))}
            return {k: walk(v) for k, v in x.items()}
        return x

    renumbered = []
    for node in nodes:
        node = walk(node)
        if "rng" in node:  # an index, not a reference (none is sent: no random op replays)
            node["rng"] = mine.setdefault(node["rng"], len(mine))
        renumbered.append(node)
    return renumbered, [inline[k] for k in mine]
