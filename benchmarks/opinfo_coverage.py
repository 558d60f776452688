"""Conformance of the capture frontend against PyTorch's OpInfo database.

For every op in ``op_db`` that supports a dtype on the CPU (float32, float16, bfloat16,
int64, bool, complex64), run its sample inputs through LazyTensor on a real appliance and compare
with local eager (same seed, so random ops are comparable too). An op passes when all its
samples match. Failures are classified:

- ``typed``: a DjinnError (UNSUPPORTED_OP, EXECUTION_ERROR...): the op is refused clearly;
- ``error``: any other exception (a gap: should become typed), or a sample eager accepts
  in a clean process but refuses after ``import djinn`` (djinn changed local PyTorch);
- ``wrong``: a result that differs from eager. This must stay at zero.

After a failure an unrelated op runs: if it fails, the failure *leaked* (issue 8 §2) and
is reported with the op that caused it rather than charged to the next op.

An op is *skipped* only when eager refuses every sample in a process that never imported
djinn: ``opinfo_reference.py`` works that out in a subprocess first (issue 8 §4) and this
run tries exactly the samples it accepted, in the same order, checked by fingerprint.

    python benchmarks/opinfo_coverage.py [--dtypes float32,float16,bfloat16,int64,bool,complex64]
        [--address unix:///...] [--ops a,b] [--limit N] [--max-samples N]
        [--reference PATH] [--json PATH]

With no address an embedded appliance is started. Prints a table per dtype, the failures,
the refused ops that cost the most, and the JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from opinfo_reference import DTYPES, OP_SEED, call_eager, digest, iter_samples, select_ops

R = "remote_accelerator:0"
REFERENCE_SCRIPT = Path(__file__).resolve().with_name("opinfo_reference.py")
# cuda_dtype: equal values in the dtype a CUDA device (and the op's meta kernel) gives, where
# the CPU kernel gives another (float32 statistics of float16 norms); not a pass, not wrong
OUTCOMES = ("pass", "cuda_dtype", "typed", "error", "wrong", "skipped")

# Ops whose outputs are uninitialised memory: only metadata is comparable.
UNINITIALISED = {
    "empty",
    "empty_like",
    "new_empty",
    "new_empty_strided",
    "empty_permuted",
    "empty_strided",
}


def eager_reference(
    dtypes: list[str], max_samples: int, ops: str = "", limit: int = 0, path: str = ""
) -> dict[str, Any]:
    """Which samples eager accepts, per dtype and op, from a process that never imported
    djinn. ``path``: reuse that file when it was made for the same parameters, else
    write it there; with no path a temporary file serves this run only."""
    want = {
        "torch": torch.__version__,
        "max_samples": max_samples,
        "hash_seed": os.environ.get("PYTHONHASHSEED"),
    }
    want_filter = {"ops": ops, "limit": limit}
    if path and Path(path).exists():
        doc = json.loads(Path(path).read_text())
        if (
            all(doc.get(k) == v for k, v in want.items())
            and doc.get("filter") == want_filter
            and set(dtypes) <= set(doc["ops"])
            and not doc.get("djinn_imported", True)
        ):
            return doc
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        out = path
    else:
        with tempfile.NamedTemporaryFile(prefix="djinn-opinfo-ref-", suffix=".json") as f:
            out = f.name  # the reference writes it whole (os.replace) when done
    cmd = [sys.executable, str(REFERENCE_SCRIPT), "--dtypes", ",".join(dtypes)]
    cmd += ["--max-samples", str(max_samples), "--ops", ops, "--limit", str(limit), "--out", out]
    # a clean process: no backend autoloading, no djinn settings (it must not import djinn)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DJINN_")}
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    try:
        subprocess.run(cmd, check=True, env=env)
        doc = json.loads(Path(out).read_text())
    finally:
        if not path:
            Path(out).unlink(missing_ok=True)
    if doc.get("djinn_imported", True):
        raise RuntimeError("the eager reference process imported djinn")
    return doc


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


# float32 and wider: 1e-5 both ways; reduced precision: torch's defaults for the dtype
_REDUCED = (torch.float16, torch.bfloat16, torch.complex32)


def _compare(got: Any, want: Any) -> None:
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            raise AssertionError(f"expected a tensor, got {type(got).__name__}")
        tol: dict[str, Any] = {} if want.dtype in _REDUCED else {"atol": 1e-5, "rtol": 1e-5}
        torch.testing.assert_close(
            got, want, equal_nan=True, check_device=False, check_stride=False, **tol
        )
    elif isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(want):
            raise AssertionError(f"expected {len(want)} outputs, got {got!r:.80}")
        for g, w in zip(got, want, strict=True):
            _compare(g, w)
    elif isinstance(want, float) and want != want:
        if got == got:
            raise AssertionError(f"expected nan, got {got}")
    elif got != want:
        raise AssertionError(f"expected {want!r}, got {got!r}")


def _cuda_dtype(got: Any, want: Any) -> bool:
    """Whether ``got`` differs from ``want`` only by float32 where the CPU kernel returned a
    reduced-precision dtype, as CUDA and the op's meta kernel do (values equal once cast)."""

    def like(g: Any, w: Any) -> Any:
        if isinstance(g, torch.Tensor) and isinstance(w, torch.Tensor):
            if g.dtype == torch.float32 and w.dtype in _REDUCED:
                return g.to(w.dtype)
            return g
        if isinstance(g, (list, tuple)) and isinstance(w, (list, tuple)) and len(g) == len(w):
            return [like(a, b) for a, b in zip(g, w, strict=True)]
        return g

    try:
        _compare(like(got, want), want)
    except AssertionError:
        return False
    return True


def _metadata(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return (x.dtype, tuple(x.shape))
    if isinstance(x, (list, tuple)):
        return [_metadata(v) for v in x]
    return x


def _call_remote(opinfo: Any, sample: Any) -> Any:
    rin, rargs, rkwargs = _to_remote((sample.input, sample.args, sample.kwargs))
    torch.manual_seed(OP_SEED)
    try:
        return _to_local(opinfo(rin, *rargs, **rkwargs))
    except RuntimeError as exc:
        if "to be on cpu" not in str(exc):
            raise
    # the op wants its other arguments on the CPU (as it would with CUDA): keep them local
    torch.manual_seed(OP_SEED)
    return _to_local(opinfo(_to_remote(sample.input), *sample.args, **sample.kwargs))


def _where(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    return frames[-1].name if frames else "?"


def run_op(opinfo: Any, dtype: torch.dtype, ref: dict[str, Any]) -> tuple[str, str, int]:
    """(outcome, detail, samples tried) for one OpInfo at one dtype, trying exactly the
    samples ``ref`` (its entry in the eager reference) says a clean eager accepts."""
    from djinn.errors import DjinnError

    accepted = dict(zip(ref["accepted"], ref["digests"], strict=True))
    if not accepted:
        return "skipped", "eager refuses every sample in a clean process", 0
    tried = 0
    last = max(accepted)
    for index, sample in iter_samples(opinfo, dtype):
        if index > last:
            break
        if index not in accepted:
            continue
        tried += 1
        if digest(sample) != accepted[index]:
            detail = f"sample {index} differs from the clean process's (PYTHONHASHSEED unpinned?)"
            return "error", detail, tried
        try:
            want = call_eager(opinfo, sample)
        except Exception as exc:
            detail = f"eager refuses sample {index} after import djinn, not in a clean process"
            return "error", f"{detail}: {type(exc).__name__}: {str(exc)[:120]}", tried
        try:
            got = _call_remote(opinfo, sample)
        except DjinnError as exc:
            return "typed", f"{exc.code}: {exc.message[:200]}", tried
        except Exception as exc:
            return "error", f"{type(exc).__name__}: {str(exc)[:160]} ({_where(exc)})", tried
        if opinfo.name in UNINITIALISED:
            got, want = _metadata(got), _metadata(want)
        try:
            _compare(got, want)
        except AssertionError as exc:
            if _cuda_dtype(got, want):
                detail = f"sample {index}: {_metadata(got)} (CPU: {_metadata(want)})"
                return "cuda_dtype", detail, tried
            return "wrong", f"sample {index}: " + str(exc).splitlines()[0][:200], tried
    if tried < len(accepted):
        return "error", f"only {tried} of {len(accepted)} reference samples regenerated", tried
    return "pass", "", tried


def leaked_failure() -> str:
    """Issue 8 §2: a failure leaves every independent tensor usable. Run after an op
    failed: an unrelated op that fails now got the failed op's leftovers. The failure it
    raises (empty: none) is reported against the op that left them, and no later op pays."""
    try:
        got = (torch.ones(2, device=R) + 1).cpu()
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    return "" if torch.equal(got, torch.full((2,), 2.0)) else f"wrong value {got}"


def run_dtype(name: str, reference: dict[str, Any], ops: str = "", limit: int = 0) -> list[dict]:
    dtype = DTYPES[name]
    refs = reference["ops"][name]
    results = []
    start = time.perf_counter()
    selected = [o for o in select_ops(dtype, ops, limit) if o.full_name in refs]
    for i, opinfo in enumerate(selected):
        outcome, detail, tried = run_op(opinfo, dtype, refs[opinfo.full_name])
        r = {"op": opinfo.full_name, "outcome": outcome, "detail": detail, "samples": tried}
        if outcome in ("typed", "error", "wrong") and (leak := leaked_failure()):
            r["leaked"] = leak
        results.append(r)
        if (i + 1) % 100 == 0:
            elapsed = time.perf_counter() - start
            print(f"  {name}: {i + 1}/{len(selected)} ops, {elapsed:.0f}s", file=sys.stderr)
    return results


def summarise(results: list[dict], seconds: float = 0.0) -> dict[str, Any]:
    counts = Counter(r["outcome"] for r in results)
    tried = len(results) - counts["skipped"]
    passed = counts["pass"]
    return {
        "ops": len(results),
        "skipped": counts["skipped"],
        "ops_tried": tried,
        "ops_passed": passed,
        "pass_rate": round(passed / tried, 4) if tried else 0.0,
        "typed_failures": counts["typed"],
        "untyped_errors": counts["error"],
        "wrong_results": counts["wrong"],
        "cuda_dtype": counts["cuda_dtype"],
        "leaking_failures": sum(1 for r in results if r.get("leaked")),
        "seconds": round(seconds, 1),
    }


_OP_NAME = re.compile(r"(\w+::[\w.]*|aten\.[\w.]*):? ")


def _refused(message: str) -> tuple[str, str]:
    """(op, why) of an UNSUPPORTED_OP message: the last op it names (a dependent op's
    error names the op that failed after its own name) and the text after it."""
    op, why = "?", message
    while m := _OP_NAME.match(why):
        op, why = m.group(1).rstrip("."), why[m.end() :]
    return op, why[:70]


def refused_ops(results_by_dtype: dict[str, list[dict]]) -> list[tuple[str, str, int, list[str]]]:
    """(op, why, OpInfo failures it causes, dtypes) for UNSUPPORTED_OP, costliest first."""
    cost: Counter[tuple[str, str]] = Counter()
    where: dict[tuple[str, str], set[str]] = {}
    for name, results in results_by_dtype.items():
        for r in results:
            if r["outcome"] == "typed" and r["detail"].startswith("UNSUPPORTED_OP: "):
                key = _refused(r["detail"].removeprefix("UNSUPPORTED_OP: "))
                cost[key] += 1
                where.setdefault(key, set()).add(name)
    order = list(DTYPES).index
    return [
        (op, why, n, sorted(where[(op, why)], key=order)) for (op, why), n in cost.most_common()
    ]


def render(summaries: dict[str, dict], results_by_dtype: dict[str, list[dict]]) -> str:
    out = []
    for name, s in summaries.items():
        out.append(f"\n### {name}\n")
        out.append(
            "| ops tried | passed | pass rate | CUDA's dtype | typed failures | untyped errors "
            "| wrong results | failures leaking into the next op | skipped (clean eager refuses) |"
        )
        out.append("|---|---|---|---|---|---|---|---|---|")
        out.append(
            f"| {s['ops_tried']} | {s['ops_passed']} | {100 * s['pass_rate']:.1f}% "
            f"| {s['cuda_dtype']} | {s['typed_failures']} | {s['untyped_errors']} "
            f"| {s['wrong_results']} | {s['leaking_failures']} | {s['skipped']} |\n"
        )
        for r in results_by_dtype[name]:
            if r["outcome"] not in ("pass", "skipped"):
                out.append(f"- {r['outcome']:5s} {r['op']}: {r['detail']}")
                if r.get("leaked"):
                    out.append(f"  - and the next unrelated op failed: {r['leaked']}")
    refused = refused_ops(results_by_dtype)
    if refused:
        out.append("\n### Refused ops (UNSUPPORTED_OP), by OpInfo failures they cause\n")
        out.append("| aten op | why | failures | dtypes |")
        out.append("|---|---|---|---|")
        out.extend(f"| {op} | {why} | {n} | {', '.join(d)} |" for op, why, n, d in refused)
    return "\n".join(out)


def _pin_hash_seed() -> None:
    """Run with ``PYTHONHASHSEED`` pinned (re-executing this script when it is not), so that
    the reference process, which inherits it, draws the same samples (Note [deterministic
    samples]: some ``sample_inputs`` iterate over sets of strings)."""
    if os.environ.get("PYTHONHASHSEED", "random") == "random":
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable, *sys.argv])


def main() -> int:
    _pin_hash_seed()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default=os.environ.get("DJINN_ADDRESS"))
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated")
    parser.add_argument("--limit", type=int, default=0, help="only the first N ops (0: all)")
    parser.add_argument("--ops", default="", help="comma-separated op names to run")
    parser.add_argument("--max-samples", type=int, default=8)
    parser.add_argument(
        "--reference", default="", help="eager reference JSON to reuse or write (default: fresh)"
    )
    parser.add_argument("--json", default="benchmarks/results/opinfo_coverage.json")
    args = parser.parse_args()
    dtypes = args.dtypes.split(",")
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown:
        parser.error(f"unknown dtypes {unknown}; choose from {','.join(DTYPES)}")
    if args.address:
        os.environ["DJINN_ADDRESS"] = args.address

    t0 = time.perf_counter()
    reference = eager_reference(dtypes, args.max_samples, args.ops, args.limit, args.reference)
    reference_s = time.perf_counter() - t0
    print(f"  eager reference (clean process): {reference_s:.0f}s", file=sys.stderr)

    import djinn  # noqa: F401 - registers the device; after the reference, never before

    warnings.simplefilter("ignore")  # deprecations from the samples, thousands of them

    results: dict[str, list[dict]] = {}
    summaries: dict[str, dict] = {}
    for name in dtypes:
        start = time.perf_counter()
        results[name] = run_dtype(name, reference, args.ops, args.limit)
        summaries[name] = summarise(results[name], time.perf_counter() - start)
    print(render(summaries, results))
    doc = {
        "summary": summaries,
        "torch": torch.__version__,
        "max_samples": args.max_samples,
        "reference": {
            "seconds": round(reference_s, 1),
            "djinn_imported": reference["djinn_imported"],
            "hash_seed": reference["hash_seed"],
        },
        "refused_ops": [
            {"op": o, "why": w, "failures": n, "dtypes": d} for o, w, n, d in refused_ops(results)
        ],
        "ops": results,
    }
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1))
    print(json.dumps({"summary": summaries}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
