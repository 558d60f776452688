"""Conformance of the capture frontend against PyTorch's OpInfo database.

For every op in ``op_db`` that supports float32 on the CPU, run its sample inputs through
LazyTensor on a real appliance and compare with local eager (same seed, so random ops are
comparable too). An op passes when all its samples match. Failures are classified:

- ``typed``: a DjinnError (UNSUPPORTED_OP, EXECUTION_ERROR...): the op is refused clearly;
- ``error``: any other exception (a gap: should become typed);
- ``wrong``: a result that differs from eager. This must stay at zero.

    python benchmarks/opinfo_coverage.py [--address unix:///...] [--limit N] [--json PATH]

With no address an embedded appliance is started. Prints a summary table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

R = "remote_accelerator:0"


def _to_remote(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().to(R).requires_grad_(x.requires_grad)
    if isinstance(x, (list, tuple)):
        return type(x)(_to_remote(v) for v in x)
    if isinstance(x, dict):
        return {k: _to_remote(v) for k, v in x.items()}
    return x


def _to_local(x: Any) -> Any:
    from djinn.frontend.lazy import LazyTensor

    if isinstance(x, LazyTensor):
        return x.cpu()
    if isinstance(x, (list, tuple)):
        vals = [_to_local(v) for v in x]
        return tuple(vals) if isinstance(x, tuple) else vals
    return x


def _compare(got: Any, want: Any) -> None:
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            raise AssertionError(f"expected a tensor, got {type(got).__name__}")
        torch.testing.assert_close(
            got, want, atol=1e-5, rtol=1e-5, equal_nan=True, check_device=False, check_stride=False
        )
    elif isinstance(want, (list, tuple)):
        if len(got) != len(want):
            raise AssertionError(f"expected {len(want)} outputs, got {len(got)}")
        for g, w in zip(got, want, strict=True):
            _compare(g, w)
    elif isinstance(want, float) and want != want:
        if got == got:
            raise AssertionError(f"expected nan, got {got}")
    elif got != want:
        raise AssertionError(f"expected {want!r}, got {got!r}")


# Ops whose outputs are uninitialised memory: only metadata is comparable.
UNINITIALISED = {
    "empty",
    "empty_like",
    "new_empty",
    "new_empty_strided",
    "empty_permuted",
    "empty_strided",
}


def _clone_inputs(x: Any) -> Any:
    """What a device transfer gives: views become compact tensors (as `.to()` copies)."""
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, (list, tuple)):
        return type(x)(_clone_inputs(v) for v in x)
    if isinstance(x, dict):
        return {k: _clone_inputs(v) for k, v in x.items()}
    return x


def _metadata(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return (x.dtype, tuple(x.shape))
    if isinstance(x, (list, tuple)):
        return [_metadata(v) for v in x]
    return x


def _call_remote(opinfo: Any, sample: Any) -> Any:
    rin, rargs, rkwargs = _to_remote((sample.input, sample.args, sample.kwargs))
    torch.manual_seed(1234)
    try:
        return _to_local(opinfo(rin, *rargs, **rkwargs))
    except RuntimeError as exc:
        if "to be on cpu" not in str(exc):
            raise
    # the op wants its other arguments on the CPU (as it would with CUDA): keep them local
    torch.manual_seed(1234)
    return _to_local(opinfo(_to_remote(sample.input), *sample.args, **sample.kwargs))


def run_op(opinfo: Any, max_samples: int) -> tuple[str, str, int]:
    """(outcome, detail, samples tried) for one OpInfo."""
    from djinn.errors import DjinnError
    from djinn.frontend import trace

    samples = opinfo.sample_inputs("cpu", torch.float32, requires_grad=False)
    tried = 0
    for sample in samples:
        if tried >= max_samples:
            break
        trace.current().nodes.clear()  # a failed sample must not poison the next one
        torch.manual_seed(1234)
        try:
            cin, cargs, ckwargs = _clone_inputs((sample.input, sample.args, sample.kwargs))
            want = opinfo(cin, *cargs, **ckwargs)
        except Exception:
            continue  # eager itself refuses this sample: not a test of Djinn
        tried += 1
        try:
            got = _call_remote(opinfo, sample)
        except DjinnError as exc:
            return "typed", f"{exc.code}: {exc.message[:160]}", tried
        except Exception as exc:
            where = traceback.extract_tb(exc.__traceback__)[-1]
            return "error", f"{type(exc).__name__}: {str(exc)[:160]} ({where.name})", tried
        if opinfo.name in UNINITIALISED:
            got, want = _metadata(got), _metadata(want)
        try:
            _compare(got, want)
        except AssertionError as exc:
            return "wrong", str(exc).splitlines()[0][:200], tried
    if tried == 0:
        return "skipped", "no sample eager accepts", 0
    return "pass", "", tried


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default=os.environ.get("DJINN_ADDRESS"))
    parser.add_argument("--limit", type=int, default=0, help="only the first N ops (0: all)")
    parser.add_argument("--ops", default="", help="comma-separated op names to run")
    parser.add_argument("--max-samples", type=int, default=8)
    parser.add_argument("--json", default="benchmarks/results/opinfo_coverage.json")
    args = parser.parse_args()
    if args.address:
        os.environ["DJINN_ADDRESS"] = args.address
    from torch.testing._internal.common_methods_invocations import op_db

    import djinn  # noqa: F401 - registers the device

    ops = [o for o in op_db if torch.float32 in o.supported_dtypes("cpu")]
    if args.ops:
        wanted = set(args.ops.split(","))
        ops = [o for o in ops if o.name in wanted or o.full_name in wanted]
    if args.limit:
        ops = ops[: args.limit]
    results: list[dict[str, Any]] = []
    start = time.perf_counter()
    for i, opinfo in enumerate(ops):
        outcome, detail, tried = run_op(opinfo, args.max_samples)
        results.append(
            {"op": opinfo.full_name, "outcome": outcome, "detail": detail, "samples": tried}
        )
        if (i + 1) % 50 == 0:
            print(f"  {i + 1}/{len(ops)} ops, {time.perf_counter() - start:.0f}s", file=sys.stderr)
    counts: dict[str, int] = {}
    for r in results:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    tried = len(results) - counts.get("skipped", 0)
    passed = counts.get("pass", 0)
    summary = {
        "ops_tried": tried,
        "ops_passed": passed,
        "pass_rate": round(passed / tried, 4) if tried else 0.0,
        "typed_failures": counts.get("typed", 0),
        "untyped_errors": counts.get("error", 0),
        "wrong_results": counts.get("wrong", 0),
        "seconds": round(time.perf_counter() - start, 1),
        "torch": torch.__version__,
    }
    print("\n| ops tried | passed | pass rate | typed failures | untyped errors | wrong results |")
    print("|---|---|---|---|---|---|")
    print(
        f"| {tried} | {passed} | {100 * summary['pass_rate']:.1f}% | {summary['typed_failures']} "
        f"| {summary['untyped_errors']} | {summary['wrong_results']} |\n"
    )
    for r in results:
        if r["outcome"] not in ("pass", "skipped"):
            print(f"- {r['outcome']:5s} {r['op']}: {r['detail']}")
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"summary": summary, "ops": results}, indent=1))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
