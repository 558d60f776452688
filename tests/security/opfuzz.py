"""Op-level fuzzing of the graph executor (issue 17 §2), run in a child process.

Hypothesis draws an allowed op, then a value for each argument of its schema: mostly
plausible values (small tensors of assorted dtypes, small ints, tagged dtypes...), often
hostile ones (enum values that do not exist, huge ints, lists of the wrong length, plain
strings where a device goes, the wrong type altogether). Each draw is one EXEC node run
through the real ``GraphRun`` (decoding, schema checks, meta run, kernel, bounds check),
exactly as a worker would run it.

The only acceptable outcomes are a result or a typed ``DjinnError``. Anything else
(an untyped Python exception) is reported; a crash kills this process, and the node being
run is already in the progress file for the parent test to show.

    python -m tests.security.opfuzz SECONDS PROGRESS_FILE [SEED]
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any

import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from djinn.appliance.executor import opargs
from djinn.appliance.executor.graph import GraphRun, resolve_op
from djinn.appliance.executor.oppolicy import allowed_names
from djinn.appliance.vmu.device import DeviceVMU
from djinn.errors import DjinnError
from djinn.protocol.tensors import to_wire

DTYPES = ["float32", "float64", "int64", "int32", "bool", "complex64", "float16", "uint8"]
INTS = [-(1 << 63), -(1 << 31), -3, -2, -1, 0, 1, 2, 3, 4, 5, 7, (1 << 31) - 1, 1 << 62, 1 << 63]
STRINGS = ["mean", "sum", "none", "floor", "trunc", "tanh", "same", "valid", "ij", "i,i->", ""]
STACK_BYTES = 64 << 20


def _shape() -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(0, 4), min_size=0, max_size=4)


@st.composite
def tensors(draw: Any, inline: list[torch.Tensor]) -> dict[str, Any]:
    dtype = getattr(torch, draw(st.sampled_from(DTYPES)))
    shape = draw(_shape())
    t = (torch.rand(shape) * 10 - 3).to(dtype) if dtype != torch.bool else torch.rand(shape) > 0.5
    if draw(st.booleans()) and t.dim() >= 2:
        t = t.transpose(0, 1)  # a non-contiguous layout now and then
    inline.append(t)
    return {"$t": len(inline) - 1, "desc": to_wire(t)[0]}


def _hostile() -> st.SearchStrategy[Any]:
    return st.one_of(
        st.none(),
        st.just([[]]),
        st.just({"a": 1}),
        st.just("meta"),
        st.just({"$dtype": "float32"}),
        st.just(2147483647),
        st.floats(allow_nan=True),
    )


def value(p: opargs.Param, inline: list[torch.Tensor]) -> st.SearchStrategy[Any]:
    base = {
        "Tensor": tensors(inline),
        "int": st.one_of(st.sampled_from(INTS), st.integers(-4, 8)),
        "float": st.one_of(st.floats(-4, 4), st.sampled_from([0.0, 1e-5, 0.5, 1e308])),
        "bool": st.booleans(),
        "Scalar": st.one_of(st.integers(-4, 8), st.floats(-4, 4), st.booleans()),
        "str": st.sampled_from(STRINGS),
        "ScalarType": st.one_of(
            st.sampled_from(DTYPES).map(lambda n: {"$dtype": n}), st.just(2147483647)
        ),
        "Layout": st.sampled_from([{"$layout": "strided"}, {"$layout": "sparse_coo"}, 2]),
        "MemoryFormat": st.sampled_from(
            [{"$mf": "contiguous_format"}, {"$mf": "channels_last"}, {"$mf": "preserve_format"}, 9]
        ),
        "Device": st.sampled_from([{"$device": "cpu"}, "meta", "cuda:7"]),
        "Generator": st.none(),
    }
    base["SymInt"] = base["int"]
    elem = base[p.base]
    if p.elem_optional:
        elem = st.one_of(st.none(), elem)
    if p.is_list:
        n = p.size or 3
        good = st.lists(elem, min_size=0, max_size=n + 1)
        if p.size:
            good = st.one_of(st.lists(elem, min_size=p.size, max_size=p.size), good)
        strat = good
    else:
        strat = elem
    if p.optional or p.list_optional:
        strat = st.one_of(st.none(), strat)
    return st.one_of(strat, strat, strat, _hostile())  # mostly well-typed, sometimes not


def node_for(draw: Any, op_name: str, inline: list[torch.Tensor]) -> dict[str, Any]:
    ps = opargs.params(resolve_op(op_name))
    args, kwargs = [], {}
    for p in ps:
        if p.has_default and draw(st.booleans()):
            continue
        v = draw(value(p, inline))
        if p.kwarg_only:
            kwargs[p.name] = v
        else:
            if len(args) < ps.index(p):  # a skipped positional: name the rest
                kwargs[p.name] = v
            else:
                args.append(v)
    return {"op": op_name, "args": args, "kwargs": kwargs}


def _encode(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return {"$float": "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")}
    if isinstance(x, list):
        return [_encode(v) for v in x]
    if isinstance(x, dict):
        return {k: _encode(v) for k, v in x.items()}
    return x


def run_one(node: dict[str, Any], inline: list[torch.Tensor]) -> str | None:
    """Run one node; None if it ended well (value or typed error), else what went wrong."""
    segments = [memoryview(to_wire(t)[1].numpy()) for t in inline]
    body = {"nodes": [node], "keep": [], "fetch": [{"$v": 0}]}
    stack = DeviceVMU(STACK_BYTES)["stack"]
    run = GraphRun(body, lambda h: torch.zeros(1), segments, torch.device("cpu"), stack)
    try:
        run.run()
    except DjinnError:
        return None
    except Exception as exc:  # untyped: a finding
        return f"{type(exc).__name__}: {exc}"[:300]
    return None


def main(seconds: float, progress_path: str, seed: int = 0) -> int:
    ops = allowed_names()
    usable = []
    for name in ops:
        try:
            opargs.params(resolve_op(name))
            usable.append(name)
        except DjinnError:
            pass
    deadline = time.monotonic() + seconds
    findings: list[str] = []
    counts = {"nodes": 0}
    progress = open(progress_path, "w", buffering=1)  # noqa: SIM115 - lives for the run

    @settings(
        max_examples=1_000_000,
        deadline=None,
        database=None,
        # the suite's run is reproducible (a failure repeats); DJINN_OP_FUZZ_RANDOM=1
        # explores new inputs each run
        derandomize=os.environ.get("DJINN_OP_FUZZ_RANDOM") != "1",
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(data=st.data(), op=st.sampled_from(usable))
    def fuzz(data: Any, op: str) -> None:
        if time.monotonic() > deadline:
            raise _Done
        inline: list[torch.Tensor] = []
        node = node_for(data.draw, op, inline)
        encoded = _encode(node)
        desc = [(str(t.dtype), list(t.shape), list(t.stride())) for t in inline]
        progress.write(json.dumps({"node": encoded, "inline": desc}, default=str) + "\n")
        counts["nodes"] += 1
        problem = run_one(encoded, inline)
        if problem:
            findings.append(f"{op}: {problem} <- {json.dumps(encoded, default=str)[:300]}")

    try:
        fuzz()
    except Exception:
        # Time is up: the test body raised _Done, and hypothesis, seeing a "failure",
        # replays it and may report it as flaky. Either way the budget is spent.
        if time.monotonic() <= deadline:
            raise
    progress.write(json.dumps({"done": counts["nodes"], "ops": len(usable)}) + "\n")
    for f in findings[:50]:
        print(f)
    print(f"fuzzed {counts['nodes']} nodes over {len(usable)} ops: {len(findings)} findings")
    return 1 if findings else 0


class _Done(Exception):
    pass


if __name__ == "__main__":
    torch.manual_seed(int(sys.argv[3]) if len(sys.argv) > 3 else 0)
    sys.exit(main(float(sys.argv[1]), sys.argv[2]))
