"""Model registration against its floor: GPT-2 small (124M parameters, ~500 MB).

Measured in one run:
- floor: blake2b over the model's bytes (what a fingerprint costs) plus one memcpy of
  them (what an upload through the arena costs at best), timed here on the client;
- cold: the first registration on a worker that was just started, before its
  background import of transformers' model code (Note [prewarm]) is done: what a user
  pays who registers the moment the appliance is up;
- warm: a registration of other weights on a worker that has registered a model before
  (fingerprint + upload + the appliance's own check of the fingerprint + build);
- shared: another session registering the same weights (it pays the fingerprint only).

    python benchmarks/registration.py [--layers 12] [--json PATH]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from _appliance import appliance, unwind_on_sigterm
from _common import MiB, note, save_json
from _report import md_table


def floor_s(model: torch.nn.Module) -> tuple[float, int]:
    """(blake2b over every weight byte + one memcpy of them, bytes)."""
    tensors = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in model.parameters()]
    nbytes = sum(t.numel() for t in tensors)
    start = time.perf_counter()
    h = hashlib.blake2b(digest_size=20)
    for t in tensors:
        h.update(memoryview(t.numpy()))
    hashed = time.perf_counter() - start
    dst = torch.empty(nbytes, dtype=torch.uint8)
    src = torch.cat(tensors)
    start = time.perf_counter()
    dst.copy_(src)
    return hashed + time.perf_counter() - start, nbytes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--json", default="benchmarks/results/registration.json")
    args = parser.parse_args()
    unwind_on_sigterm()
    import transformers

    cfg = transformers.GPT2Config(n_layer=args.layers)

    def model(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return transformers.GPT2LMHeadModel(cfg).eval()

    models = [model(0), model(1)]
    floor, nbytes = floor_s(models[0])
    with (
        tempfile.TemporaryDirectory() as tmp,
        appliance(Path(tmp), 2048 * MiB, "none", warm=False) as app,
    ):
        os.environ["DJINN_ADDRESS"] = app.unix
        from djinn.frontend import remote_module
        from djinn.runtime.client import Client

        with Client(app.unix) as client, client.session() as s, client.session() as other:
            timings = {}
            for name, m, session in (
                ("cold", models[0], s),
                ("warm", models[1], s),
                ("shared", models[1], other),
            ):
                note(f"registering ({name})")
                start = time.perf_counter()
                info = remote_module.register(m, session)
                timings[name] = (time.perf_counter() - start, info["uploaded"])
    rows = [["floor: blake2b + memcpy", f"{floor:.2f}", "1.00", "-"]]
    rows += [
        [name, f"{t:.2f}", f"{t / floor:.2f}", "yes" if up else "no"]
        for name, (t, up) in timings.items()
    ]
    print(f"\nGPT-2 {args.layers} layers, {nbytes / 1e6:.0f} MB of weights\n")
    print(md_table(["registration", "seconds", "x floor", "uploaded"], rows))
    doc = {"bytes": nbytes, "floor_s": floor, "torch": torch.__version__}
    doc.update({k: {"s": t, "uploaded": up} for k, (t, up) in timings.items()})
    save_json(doc, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
