"""The eager reference for the OpInfo conformance run: which samples eager PyTorch accepts,
per op and dtype, computed in a process that never imported djinn.

``opinfo_coverage.py`` may count an op as *skipped* only when eager refuses its samples
here, in a clean process, and not merely after ``import djinn`` (issue 8 §4): a sample
that eager accepts here but refuses beside djinn is djinn changing local PyTorch, and is
reported as an error, not skipped. Run as a script (``opinfo_coverage.py`` does it with
``subprocess``), it writes JSON:

    {"torch": ..., "max_samples": N, "djinn_imported": false,
     "ops": {"float32": {"<op full name>": {"accepted": [i, ...], "digests": [...],
                                             "seen": n}, ...}, ...}}

``accepted`` are indices in the order ``sample_inputs`` yields them, at most
``max_samples``; ``digests`` fingerprint those samples so the djinn run can check it
regenerated the very same inputs.

Note [deterministic samples]: both processes must draw the same samples. The CPU
generator (and Python's and NumPy's) are seeded before ``sample_inputs`` and restored
around every sample handed out, so the random draws of a sample never depend on what ran
between samples (an eager call here, a remote call and djinn's own bookkeeping there).
Both processes also need the same ``PYTHONHASHSEED``: some ``sample_inputs`` iterate over
sets of strings (meshgrid's ``{'xy', 'ij'}``), whose order, and so which sample draws
which random values, follows the string hash. ``opinfo_coverage.py`` pins it.

This module must never import djinn, at module level or anywhere else; the coverage
script imports it for ``iter_samples``, ``select_ops`` and ``digest``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "bool": torch.bool,
    "complex64": torch.complex64,
}
SAMPLE_SEED = 0  # seeds sample generation (Note [deterministic samples])
OP_SEED = 1234  # seeds every eager and remote call, so random ops are comparable


def select_ops(dtype: torch.dtype, names: str = "", limit: int = 0) -> list[Any]:
    """The OpInfos that support ``dtype`` on the CPU, optionally by name, in op_db order."""
    from torch.testing._internal.common_methods_invocations import op_db

    ops = [o for o in op_db if dtype in o.supported_dtypes("cpu")]
    if names:
        wanted = set(names.split(","))
        ops = [o for o in ops if o.name in wanted or o.full_name in wanted]
    return ops[:limit] if limit else ops


def _seed_samples() -> None:
    torch.default_generator.manual_seed(SAMPLE_SEED)
    random.seed(SAMPLE_SEED)
    np.random.seed(SAMPLE_SEED)


def iter_samples(opinfo: Any, dtype: torch.dtype) -> Iterator[tuple[int, Any]]:
    """(index, sample) in ``sample_inputs`` order, the same in every process (Note
    [deterministic samples]). A ``sample_inputs`` that raises yields what it gave so far."""
    _seed_samples()
    try:
        it = iter(opinfo.sample_inputs("cpu", dtype, requires_grad=False))
    except Exception:
        return
    index = 0
    while True:
        try:
            sample = next(it)
        except StopIteration:
            return
        except Exception:
            return
        state = (torch.get_rng_state(), random.getstate(), np.random.get_state())
        yield index, sample
        torch.set_rng_state(state[0])
        random.setstate(state[1])
        np.random.set_state(state[2])
        index += 1


def _feed(h: Any, x: Any) -> None:
    if isinstance(x, torch.Tensor):
        h.update(f"T{x.dtype}{tuple(x.shape)}{x.layout}".encode())
        if x.layout == torch.strided and x.device.type == "cpu":
            flat = x.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
            h.update(flat.view(torch.uint8).numpy().tobytes())
    elif isinstance(x, (list, tuple)):
        h.update(f"{type(x).__name__}{len(x)}".encode())
        for v in x:
            _feed(h, v)
    elif isinstance(x, dict):
        for k in sorted(x, key=str):
            h.update(str(k).encode())
            _feed(h, x[k])
    elif x is None or isinstance(x, (bool, int, float, complex, str, torch.dtype)):
        h.update(repr(x).encode())
    else:
        h.update(type(x).__name__.encode())  # functions, layouts...: no stable repr


def digest(sample: Any) -> str:
    """A fingerprint of a sample's input, args and kwargs (values included)."""
    h = hashlib.blake2b(digest_size=8)
    _feed(h, (sample.input, sample.args, sample.kwargs))
    return h.hexdigest()


def clone_inputs(x: Any) -> Any:
    """What a device transfer gives: views become compact tensors (as ``.to()`` copies)."""
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, (list, tuple)):
        return type(x)(clone_inputs(v) for v in x)
    if isinstance(x, dict):
        return {k: clone_inputs(v) for k, v in x.items()}
    return x


def call_eager(opinfo: Any, sample: Any) -> Any:
    """The op on a copy of the sample, seeded as the remote call will be."""
    cin, cargs, ckwargs = clone_inputs((sample.input, sample.args, sample.kwargs))
    torch.manual_seed(OP_SEED)
    return opinfo(cin, *cargs, **ckwargs)


def reference_for(opinfo: Any, dtype: torch.dtype, max_samples: int) -> dict[str, Any]:
    accepted: list[int] = []
    digests: list[str] = []
    seen = 0
    for index, sample in iter_samples(opinfo, dtype):
        seen = index + 1
        try:
            call_eager(opinfo, sample)
        except Exception:
            continue
        accepted.append(index)
        digests.append(digest(sample))
        if len(accepted) >= max_samples:
            break
    return {"accepted": accepted, "digests": digests, "seen": seen}


def build(dtypes: list[str], max_samples: int, names: str = "", limit: int = 0) -> dict:
    ops: dict[str, dict[str, Any]] = {}
    for name in dtypes:
        dtype = DTYPES[name]
        ops[name] = {
            o.full_name: reference_for(o, dtype, max_samples)
            for o in select_ops(dtype, names, limit)
        }
    return {
        "torch": torch.__version__,
        "max_samples": max_samples,
        "sample_seed": SAMPLE_SEED,
        "op_seed": OP_SEED,
        "filter": {"ops": names, "limit": limit},
        "hash_seed": os.environ.get("PYTHONHASHSEED"),
        "djinn_imported": any(m == "djinn" or m.startswith("djinn.") for m in sys.modules),
        "ops": ops,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--max-samples", type=int, default=8)
    parser.add_argument("--ops", default="")
    parser.add_argument("--limit", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # deprecations from the samples, thousands of them
    doc = build(args.dtypes.split(","), args.max_samples, args.ops, args.limit)
    if doc["djinn_imported"]:  # a .pth, sitecustomize or backend autoload brought it in
        print("opinfo_reference: djinn was imported; the reference is void", file=sys.stderr)
        return 1
    tmp = f"{args.out}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
