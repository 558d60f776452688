#!/usr/bin/env python
"""BERT given an attention mask, on the graph path: captured, replayed, and local eager.

Hugging Face's mask helpers read a value of the mask (``attention_mask.all()``, to skip
the mask when nothing is padded). Before Note [values the client knows]
(djinn/frontend/known.py) that read waited for a graph of its own, and made a
``djinn.replayable`` call run as it was at every call: BERT given a mask never replayed.
The client now computes such a read from the copy it keeps of the mask it uploaded, and a
replay checks it again.

A ``BertModel`` built from a config (random weights: nothing is downloaded), moved in
training mode so that it stays on the graph path, runs ``--calls`` batches of ``--batch``
x ``--seq`` token ids, every fourth without padding and the others padded (a padded and an
unpadded batch take different branches of the mask helper). Three loops, in turn in each
of ``--repeat`` rounds so all see the same machine:

- inference: ``last_hidden_state`` under ``no_grad``, read back (``.cpu()``) each call;
- fine-tuning: ``BertForSequenceClassification`` with dropout, SGD, the loss read back
  each call; parameters compared with local eager's at the end (the same dropout draws);

each as local eager, as plain calls captured op by op, and as ``djinn.replayable``.
Reported: ms per call after the first ``STEADY_FROM`` calls (median of rounds), remote /
local, the replay stats, and the largest difference from local eager.

    python benchmarks/masked_bert.py                 # 4 layers, width 256, 3 rounds
    python benchmarks/masked_bert.py --calls 12 --repeat 1

With DJINN_ADDRESS unset an embedded appliance is started.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch
from _common import note, save_json

STEADY_FROM = 8  # calls left out of the time: recordings of both kinds of batch


def batches(args: argparse.Namespace, labels: bool) -> list[tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for k in range(args.calls):
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
        mask = torch.ones(args.batch, args.seq, dtype=torch.long)
        if k % 4 != 3:  # padded: each row its own length
            lengths = torch.randint(args.seq // 2, args.seq, (args.batch,), generator=gen)
            for row, n in enumerate(lengths.tolist()):
                mask[row, n:] = 0
        y = torch.randint(0, 2, (args.batch,), generator=gen)
        out.append((ids, mask, y) if labels else (ids, mask))
    return out


def timed(calls: list, run) -> tuple[float, list]:
    """ms per call after STEADY_FROM, and what each call read back."""
    got, stamps = [], []
    for args in calls:
        got.append(run(*args))
        stamps.append(time.perf_counter())
    steady = (stamps[-1] - stamps[STEADY_FROM - 1]) / (len(calls) - STEADY_FROM)
    return steady * 1e3, got


def inference(args, local, remote_model, data, replay: bool):
    import djinn

    def fwd(ids, mask):
        return remote_model(input_ids=ids, attention_mask=mask).last_hidden_state

    run = djinn.replayable(fwd) if replay else fwd
    dev = "remote_accelerator:0"
    with torch.no_grad():
        ms, got = timed(data, lambda i, m: run(i.to(dev), m.to(dev)).cpu())
    return ms, got, run.stats() if replay else None


def local_inference(local, data):
    with torch.no_grad():
        return timed(data, lambda i, m: local(input_ids=i, attention_mask=m).last_hidden_state)


def training(model, data, device: str, replay: bool):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def step(ids, mask, y):
        loss = model(input_ids=ids, attention_mask=mask, labels=y).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    run = step
    if replay:
        import djinn

        run = djinn.replayable(step)
    torch.manual_seed(2)  # the dropout draws: the same in every loop
    ms, got = timed(data, lambda i, m, y: run(i.to(device), m.to(device), y.to(device)).cpu())
    return ms, got, run.stats() if replay else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--calls", type=int, default=24)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", default="benchmarks/results/masked_bert.json")
    args = parser.parse_args()
    if args.calls <= STEADY_FROM + 1:
        parser.error(f"--calls must be more than {STEADY_FROM + 1}")
    from transformers import BertConfig, BertForSequenceClassification, BertModel

    import djinn  # noqa: F401 - the remote device

    dev = "remote_accelerator:0"
    cfg = BertConfig(
        num_hidden_layers=args.layers, hidden_size=args.width,
        num_attention_heads=max(1, args.width // 64), intermediate_size=4 * args.width,
        vocab_size=args.vocab, max_position_embeddings=max(512, args.seq), num_labels=2,
    )  # fmt: skip
    torch.manual_seed(0)
    encoder = BertModel(cfg).eval()
    remote_encoder = copy.deepcopy(encoder).train().to(dev).eval()
    torch.manual_seed(0)
    classifier = BertForSequenceClassification(cfg).train()
    fwd_data, train_data = batches(args, labels=False), batches(args, labels=True)
    rows: dict[str, list[float]] = {}
    stats: dict[str, object] = {}
    diffs: dict[str, float] = {}
    for r in range(args.repeat):
        note(f"round {r + 1}/{args.repeat}")
        want_ms, want = local_inference(encoder, fwd_data)
        rows.setdefault("inference local", []).append(want_ms)
        for name, replay in (("captured", False), ("replayed", True)):
            ms, got, st = inference(args, encoder, remote_encoder, fwd_data, replay)
            rows.setdefault(f"inference {name}", []).append(ms)
            pairs = zip(got, want, strict=True)
            diffs[f"inference {name}"] = max((a - b).abs().max().item() for a, b in pairs)
            if st:
                stats["inference"] = st
        base = copy.deepcopy(classifier)
        want_ms, want = training(base, train_data, "cpu", False)[:2]
        rows.setdefault("fine-tuning local", []).append(want_ms)
        for name, replay in (("captured", False), ("replayed", True)):
            model = copy.deepcopy(classifier).to(dev)
            ms, got, st = training(model, train_data, dev, replay)
            rows.setdefault(f"fine-tuning {name}", []).append(ms)
            diffs[f"fine-tuning {name}"] = max(
                (a - b.cpu()).abs().max().item()
                for a, b in zip(base.parameters(), model.parameters(), strict=True)
            )
            if st:
                stats["fine-tuning"] = st
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"\nBERT {args.layers} layers, width {args.width}, batch {args.batch} x {args.seq}, "
          f"{args.calls} calls (every 4th unpadded), ms per call from call {STEADY_FROM + 1}, "
          f"median of {args.repeat}\n")  # fmt: skip
    print(
        "| loop | local ms | captured ms (/ local) | replayed ms (/ local) "
        "| max diff captured; replayed |"
    )
    print("|---|---|---|---|---|")
    for part in ("inference", "fine-tuning"):
        loc, cap, rep = (med[f"{part} {k}"] for k in ("local", "captured", "replayed"))
        print(f"| {part} | {loc:.1f} | {cap:.1f} ({cap / loc:.2f}) | {rep:.1f} ({rep / loc:.2f}) | "
              f"{diffs[f'{part} captured']:.1e}; {diffs[f'{part} replayed']:.1e} |")  # fmt: skip
    for part, st in stats.items():
        print(f"\n{part} replay stats: {st}")
    save_json({"benchmark": "masked_bert", "args": vars(args), "ms": rows, "median_ms": med,
               "max_diff": diffs, "replay_stats": stats}, args.json)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
