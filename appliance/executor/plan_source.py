"""Compiled plans: a plan's nodes as one generated Python function (Note [compiled plans]).

Note [compiled plans]: a plan (Note [graph plans]) skips the decoding and the checks of
every node, but still steps through each node in Python: the scheduler's generator, the
getters that build its arguments, the stack's account, the bounds of what it returned,
the intra-op threads. On a 2-core host that was about 20 µs a node, as much as the
kernels of a small training step (``benchmarks/training_step.py``): local eager runs
such a step's 394 aten ops in 4.2 ms; a straight-line Python loop over the same ops,
5 ms; the planned run, 14 ms. So once a plan has run ``graph_compile_after`` times, its
nodes are written out as the source of one Python function and compiled with
``compile()``: one line per node that calls the op's C++ entry point on arguments that are
local names, list items or constants bound in the function's namespace, then a line that
lets go of each value at its last use. What a plan still did per node is done once per run
instead:

- the stack: the most bytes the recorded run held at once (its outputs, and each op's
  allocation before it ran) is reserved before the first node, and released after the
  last. A run that is short waits before anything ran, so it can always run again
  (Note [rerunnable graphs]);
- the threads and the scheduler: the function yields every ``CHUNK`` nodes, setting the
  graph's intra-op threads for each chunk (Note [a capturing client beside its worker]);
- the bounds of views: the geometry of every value follows from the inputs' signature and
  the template, which the recorded run checked (a template that names a handle outside
  its inputs gets no plan), so only the ``as_strided`` family, whose geometry is an
  argument, is checked again.

A node that needs more than its kernel goes through ``CompiledRun.slow``, the same code as
an interpreted node's: a random op (seeded from its request), an op whose checks read
values (Note [value checks in a plan]), an output the recorded run cast (Note [meta
dtypes]; the inputs' dtypes are the plan's, so a node the recorded run did not cast needs
no cast), an ``as_strided``. The kernels and their arguments are the plan's, so the results
are the same bits. When a node fails, the function hands its index to ``CompiledRun.fail``,
which raises, or
with "partial" ends the run where an interpreted one would (Note [partial graphs]).

Safety: nothing the client sent is written into the source. Ops, handles, strings, floats
and every other constant are bound to generated names (``c12``) in the function's
namespace; the text holds only those names, node and input indices (ints the recorded run
checked, checked again here) and keyword names that are Python identifiers (the op's
schema's). The namespace has no builtins. A plan that cannot be written (too big, a value
of an unexpected kind) stays a plan; the counts say how many.
"""

from __future__ import annotations

import keyword
from collections.abc import Callable, Iterator
from typing import Any

import torch

from djinn.protocol.graph import MAX_DEPTH
from djinn.protocol.values import decode_constant

COMPILE_MAX_NODES = 20_000  # compile() of a bigger plan would hold the worker too long
COMPILE_MAX_CHARS = 1 << 20  # nor of a longer source (a node may name thousands of values)
CHUNK = 8  # nodes between two yields to the scheduler
LITERAL_LIST = 8  # a constant list at most this long is written out; longer ones are bound
_PLAIN = (int, float, bool, str, type(None))


class NotCompilable(Exception):
    """A plan the generator will not write as source."""


def compile_plan(
    nodes: list[Any],
    source_nodes: list[dict[str, Any]],
    last_use: dict[int, list[int]],
    slow: Callable[[int], bool],
    inputs: int,
    scalars: int,
    device: torch.device,
    label: str,
) -> Callable[..., Iterator[None]]:
    """The generator function that runs a plan's ``nodes`` (its ``source_nodes`` are the
    template's, with the arguments); ``slow(i)`` says which go through ``R.slow``. It is
    called as ``fn(R, V, I, S, L)``: the run, a list of one slot per node, the input
    tensors, the scalars and the handle lookup."""
    if len(nodes) > COMPILE_MAX_NODES:
        raise NotCompilable(f"{len(nodes)} nodes (at most {COMPILE_MAX_NODES} are compiled)")
    w = _Writer(inputs, scalars, device)
    body, chars = ["R.enter()"], 0
    for i, (node, src) in enumerate(zip(nodes, source_nodes, strict=True)):
        mark = len(body)
        if i and i % CHUNK == 0:
            body += ["R.leave()", "yield", "R.enter()"]
        body.append(f"i = {i}")
        args = src.get("args", [])
        kwargs = src.get("kwargs", {})
        if not isinstance(args, list) or not isinstance(kwargs, dict):
            raise NotCompilable(f"node {i}: args must be a list and kwargs an object")
        arg_src = [w.expr(a, i) for a in args]
        if slow(i):
            pairs = ", ".join(f"{w.const(k)}: {w.expr(v, i)}" for k, v in kwargs.items())
            body.append(f"V[{i}] = R.slow({i}, [{', '.join(arg_src)}], {{{pairs}}})")
        else:
            for k in kwargs:
                if not (isinstance(k, str) and k.isidentifier() and not keyword.iskeyword(k)):
                    raise NotCompilable(f"node {i}: keyword {k!r} is not a Python name")
            arg_src += [f"{k}={w.expr(v, i)}" for k, v in kwargs.items()]
            body.append(f"V[{i}] = {w.op(node.op)}({', '.join(arg_src)})")
        for j in last_use.get(i, ()):
            body.append(f"V[{_int(j, 0, i)}] = None")
        chars += sum(len(line) for line in body[mark:])
        if chars > COMPILE_MAX_CHARS:  # checked as it grows: refusing takes no longer
            raise NotCompilable(f"a source of more than {COMPILE_MAX_CHARS} characters")
    body.append("R.leave()")
    text = "\n".join(
        [
            "def plan(R, V, I, S, L):",
            "    i = 0",
            "    try:",
            *("        " + line for line in body),
            "    except Exception as exc:",
            "        R.leave()",
            "        R.fail(i, exc)",
            "    return",
            "    yield",  # a generator even for a plan of one chunk
        ]
    )
    namespace: dict[str, Any] = {"__builtins__": {}, "Exception": Exception, **w.names}
    exec(compile(text, f"<djinn plan {label}>", "exec"), namespace)  # source: see the Note
    return namespace["plan"]


class _Writer:
    """Source expressions for a template's values, constants bound to generated names."""

    def __init__(self, inputs: int, scalars: int, device: torch.device) -> None:
        self.inputs, self.scalars, self.device = inputs, scalars, device
        self.names: dict[str, Any] = {}
        self._ops: dict[Any, str] = {}

    def const(self, value: Any) -> str:
        name = f"c{len(self.names)}"
        self.names[name] = value
        return name

    def op(self, op: Any) -> str:
        """The op's C++ entry point (``OpOverload.__call__`` is a Python frame around it)."""
        name = self._ops.get(op)
        if name is None:
            name = self._ops[op] = self.const(getattr(op, "_op", op))
        return name

    def expr(self, x: Any, at: int, depth: int = 0) -> str:
        """``x``, a value of node ``at``'s arguments, as an expression."""
        if depth > MAX_DEPTH:
            raise NotCompilable(f"node {at}: arguments nested too deeply")
        if x is None or x is True or x is False or type(x) is int:
            return repr(x)  # an int's repr is its literal
        if isinstance(x, list):
            if len(x) > LITERAL_LIST and all(type(v) in _PLAIN for v in x):
                return self.const(list(x))  # a long shape or index list, bound once
            return f"[{', '.join(self.expr(v, at, depth + 1) for v in x)}]"
        if not isinstance(x, dict):
            return self.const(x)  # floats (inf, nan) and strings: never written as text
        if len(x) == 1 and "$in" in x:
            return f"I[{_int(x['$in'], 0, self.inputs)}]"
        if len(x) == 1 and "$s" in x:
            return f"S[{_int(x['$s'], 0, self.scalars)}]"
        if "$h" in x:  # before "$v", as GraphRun._ref reads it (plans refuse them)
            return f"L({self.const(x['$h'])})"
        if "$v" in x:
            ref = f"V[{_int(x['$v'], 0, at)}]"
            return ref if x.get("i") is None else f"{ref}[{_int(x['i'], 0, 1 << 16)}]"
        if "$t" in x:
            return f"R.inline({self.const(x)})"
        if tagged_with_scalars(x):
            return f"R.filled({self.const(x)})"
        found, value = decode_constant(x, self.device)
        if found:
            return self.const(value)  # decoded once, as a plan's constants are
        pairs = ", ".join(f"{self.const(k)}: {self.expr(v, at, depth + 1)}" for k, v in x.items())
        return f"{{{pairs}}}"


def _int(v: Any, low: int, high: int) -> int:
    if type(v) is not int or not low <= v < high:
        raise NotCompilable(f"index {v!r} outside [{low}, {high})")
    return v


def tagged_with_scalars(x: dict[str, Any]) -> bool:
    """A tagged constant made of floats the template took out (``{"$complex": [re, im]}``
    with ``{"$s": k}`` parts): decoded on each run, with that run's scalars."""
    return any(isinstance(k, str) and k.startswith("$") for k in x) and _has_scalar(x)


def _has_scalar(x: Any) -> bool:
    if isinstance(x, list):
        return any(_has_scalar(v) for v in x)
    if isinstance(x, dict):
        return (len(x) == 1 and "$s" in x) or any(_has_scalar(v) for v in x.values())
    return False
