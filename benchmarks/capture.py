"""Capture cost and remote-vs-local time for a GPT-2 forward.

Measures, in one run on one appliance:
- capture cost: µs per captured op while tracing a GPT-2 forward into LazyTensors with no
  execution (cold: first time each op signature is seen; warm: cached meta inference);
- its floor: the same forward through a bare wrapper subclass whose ``__torch_dispatch__``
  only builds its outputs (recorded on a first pass, replayed after): what any lazy
  tensor pays in PyTorch's dispatcher and Python, with no trace, no inference, no graph;
- end to end: remote forward (capture + ship + execute + fetch logits) against local eager,
  timed in turn in each of ``--repeat`` rounds so both see the same machine;
- replayed: the same forward through ``djinn.replayable`` (Note [replayable functions]),
  sent by its template's fingerprint with no op captured, in the same rounds; with the
  client's own CPU time per replay, per op, and its request bytes (issue 11: at most 10
  µs per op, constant in the op count); and the transformer alone, returning its last
  hidden state, which is a view of its final layer norm's output (Note [a returned
  view's base]: before stop 41 such a call ran op by op at every call), against local
  eager's transformer in the same rounds;
- with ``--compiled``, the local model under ``torch.compile`` (inductor) in the same
  rounds: what compiling buys on this machine (issue 11's "once compiled" target).

    python benchmarks/capture.py [--layers 12] [--tokens 64] [--repeat 5] [--compiled]

With DJINN_ADDRESS unset an embedded appliance is started. Design target: at most 20 µs
per captured op (warm).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time

import torch
from _common import save_json


class Bare(torch.Tensor):
    """The floor: a wrapper subclass whose ``__torch_dispatch__`` only builds its outputs.

    The first forward runs each op on meta tensors and records what it returned; later
    forwards replay those records in order, so an op costs the dispatcher, one Python
    call and the output wrappers, and nothing else (no shape inference, no trace)."""

    record: list[object] = []
    replay: list[object] | None = None
    calls = 0

    @staticmethod
    def __new__(cls, like: torch.Tensor) -> Bare:
        out = torch.Tensor._make_wrapper_subclass(
            cls, like.shape, strides=like.stride(), storage_offset=like.storage_offset(),
            dtype=like.dtype, device=like.device,
        )  # fmt: skip
        out.elem = like
        return out

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if Bare.replay is not None:
            out = Bare.replay[Bare.calls]
            Bare.calls += 1
            if type(out) is tuple:
                return tuple(Bare(t) if isinstance(t, torch.Tensor) else t for t in out)
            return Bare(out) if isinstance(out, torch.Tensor) else out
        Bare.calls += 1
        unwrap = lambda x: x.elem if isinstance(x, Bare) else x  # noqa: E731
        out = func(*torch.utils._pytree.tree_map(unwrap, args),
                   **torch.utils._pytree.tree_map(unwrap, kwargs or {}))  # fmt: skip
        Bare.record.append(tuple(out) if isinstance(out, list) else out)
        wrap = lambda x: Bare(x) if isinstance(x, torch.Tensor) else x  # noqa: E731
        return torch.utils._pytree.tree_map(wrap, out)


def bare_forward_s(model: torch.nn.Module, ids: torch.Tensor, repeat: int) -> tuple[float, int]:
    """Median seconds of a replayed forward through ``Bare`` tensors, and ops per forward."""
    meta_model = copy.deepcopy(model).to("meta")
    params = {n: Bare(t) for n, t in meta_model.state_dict(keep_vars=True).items()}
    bare_ids = Bare(ids.to("meta"))
    samples = []
    with torch.no_grad():
        Bare.record, Bare.replay, Bare.calls = [], None, 0
        torch.func.functional_call(meta_model, params, (bare_ids,))  # records
        Bare.replay = Bare.record
        for _ in range(repeat):
            Bare.calls = 0
            start = time.perf_counter()
            torch.func.functional_call(meta_model, params, (bare_ids,))
            samples.append(time.perf_counter() - start)
    Bare.replay = None
    return statistics.median(samples), Bare.calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", default="benchmarks/results/capture.json")
    parser.add_argument(
        "--compiled",
        action="store_true",
        help="also time the local model under torch.compile (inductor; compiles for ~30 s)",
    )
    args = parser.parse_args()

    import transformers

    import djinn  # registers the remote device
    from djinn.frontend import trace

    cfg = transformers.GPT2Config(n_layer=args.layers)
    torch.manual_seed(0)
    local = transformers.GPT2LMHeadModel(cfg).eval()
    t0 = time.perf_counter()
    # moved in training mode so it stays on the graph path (an eval-mode transformers model
    # would register on the model path, where nothing is captured op by op), then eval
    remote = copy.deepcopy(local).train().to("remote_accelerator:0").eval()
    assert getattr(remote, "_djinn", None) is None, "expected the graph path"
    ids = torch.randint(0, cfg.vocab_size, (1, args.tokens))
    rids = ids.to("remote_accelerator:0")
    with torch.no_grad():
        remote(rids).logits.cpu()  # weights materialise as handles; warms the appliance
    upload_s = time.perf_counter() - t0
    n_params = sum(p.numel() for p in local.parameters())

    tr = trace.current()
    chunk_ops = tr.chunk_ops  # graph_chunk_ops, Note [streamed graphs]

    def capture_only() -> tuple[float, int]:
        tr.nodes.clear()
        tr.chunk_ops = 0  # capture alone: nothing is sent, not even a streamed part
        start = time.perf_counter()
        with torch.no_grad():
            remote(rids)
        elapsed = time.perf_counter() - start
        n = len(tr.nodes)
        tr.nodes.clear()  # discard: nothing executes
        tr.chunk_ops = chunk_ops
        return elapsed, n

    def unstreamed() -> None:
        tr.chunk_ops = 0  # the whole forward as one graph, sent when the logits are read
        try:
            remote(rids).logits.cpu()
        finally:
            tr.chunk_ops = chunk_ops

    from djinn.frontend import meta

    meta.clear_cache()
    cold_s, n_ops = capture_only()
    warm = [capture_only()[0] for _ in range(args.repeat)]
    warm_s = statistics.median(warm)
    floor_s, floor_ops = bare_forward_s(local, ids, args.repeat)

    def timed_once(fn) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    replayed = djinn.replayable(lambda x: remote(x).logits)
    hidden = djinn.replayable(lambda x: remote.transformer(x).last_hidden_state)
    from djinn.frontend.session import default_session

    channel = default_session().channel

    def replay_client() -> tuple[float, int]:
        """The calling thread's CPU seconds and the request's bytes for one replay, the
        logits not fetched (the thread is blocked, not computing, while the appliance
        runs the graph; the idle OpenMP threads' spinning is not the replay's)."""
        b0 = channel.call_bytes()
        c0 = time.thread_time()
        out = replayed(rids)
        spent = time.thread_time() - c0
        bytes_ = channel.call_bytes() - b0
        out.cpu()
        return spent, bytes_

    with torch.no_grad():
        local(ids)  # warm
        for _ in range(replayed.after + 1):  # recorded, confirmed, then replayed
            replayed(rids).cpu()
            hidden(rids).cpu()
        compiled = None
        if args.compiled:
            compiled = torch.compile(local)
            start = time.perf_counter()
            compiled(ids)
            compile_s = time.perf_counter() - start
        # local eager, remote streamed and unstreamed (and compiled) in turn each round,
        # so every one sees the same machine
        rounds = [
            (
                timed_once(lambda: local(ids).logits),
                timed_once(lambda: remote(rids).logits.cpu()),
                timed_once(unstreamed),
                timed_once(lambda: compiled(ids).logits) if compiled is not None else 0.0,
                timed_once(lambda: replayed(rids).cpu()),
                timed_once(lambda: local.transformer(ids).last_hidden_state),
                timed_once(lambda: hidden(rids).cpu()),
            )
            for _ in range(args.repeat)
        ]
        local_hidden_s = statistics.median(r[5] for r in rounds)
        hidden_s = statistics.median(r[6] for r in rounds)
        hidden_diff = (hidden(rids).cpu() - local.transformer(ids).last_hidden_state).abs().max()
        local_s = statistics.median(r[0] for r in rounds)
        remote_s = statistics.median(r[1] for r in rounds)
        whole_s = statistics.median(r[2] for r in rounds)
        compiled_s = statistics.median(r[3] for r in rounds)
        replay_s = statistics.median(r[4] for r in rounds)
        client = [replay_client() for _ in range(args.repeat)]
        got = remote(rids).logits.cpu()
        want = local(ids).logits
        got_replayed = replayed(rids).cpu()
    diff = (got - want).abs().max().item()
    replay_diff = (got_replayed - want).abs().max().item()
    replay_stats = replayed.stats()
    client_s = statistics.median(c for c, _ in client)
    request_bytes = statistics.median(b for _, b in client)

    result = {
        "model": f"GPT-2 {args.layers} layers ({n_params / 1e6:.0f}M params)",
        "tokens": args.tokens,
        "ops_per_forward": n_ops,
        "capture_us_per_op_cold": round(cold_s / n_ops * 1e6, 2),
        "capture_us_per_op_warm": round(warm_s / n_ops * 1e6, 2),
        "capture_ms_per_forward_warm": round(warm_s * 1e3, 2),
        "floor_ops_per_forward": floor_ops,
        "floor_us_per_op": round(floor_s / floor_ops * 1e6, 2),
        "floor_ms_per_forward": round(floor_s * 1e3, 2),
        "capture_over_floor_per_forward": round(warm_s / floor_s, 2),
        "local_eager_ms": round(local_s * 1e3, 2),
        "remote_ms": round(remote_s * 1e3, 2),
        "remote_over_local": round(remote_s / local_s, 3),
        "graph_chunk_ops": chunk_ops,
        "remote_unstreamed_ms": round(whole_s * 1e3, 2),
        "remote_unstreamed_over_local": round(whole_s / local_s, 3),
        "max_abs_diff": diff,
        "replayed_ms": round(replay_s * 1e3, 2),
        "replayed_over_local": round(replay_s / local_s, 3),
        "replay_client_cpu_ms": round(client_s * 1e3, 3),
        "replay_client_us_per_op": round(client_s / n_ops * 1e6, 2),
        "replay_request_bytes": request_bytes,
        "replay_max_abs_diff": replay_diff,
        "replay_stats": replay_stats,
        "weights_upload_s": round(upload_s, 2),
        "target_us_per_op": 20,
        "local_hidden_ms": round(local_hidden_s * 1e3, 2),
        "hidden_replayed_ms": round(hidden_s * 1e3, 2),
        "hidden_replayed_over_local": round(hidden_s / local_hidden_s, 3),
        "hidden_max_abs_diff": hidden_diff.item(),
        "hidden_stats": hidden.stats(),
    }
    if compiled is not None:
        result["local_compiled_ms"] = round(compiled_s * 1e3, 2)
        result["local_compiled_over_eager"] = round(compiled_s / local_s, 3)
        result["compile_s"] = round(compile_s, 1)
    print(f"\n{result['model']}, {args.tokens} tokens, {n_ops} ops per forward\n")
    print("| measure | value |")
    print("|---|---|")
    print(f"| capture, cold (µs/op) | {result['capture_us_per_op_cold']} |")
    print(f"| capture, warm (µs/op) | {result['capture_us_per_op_warm']} (target ≤ 20) |")
    print(f"| capture per forward, warm (ms) | {result['capture_ms_per_forward_warm']} |")
    print(
        f"| floor: bare dispatch (µs/op, ms/forward, ops) | {result['floor_us_per_op']}, "
        f"{result['floor_ms_per_forward']}, {floor_ops} |"
    )
    print(f"| warm capture / floor, per forward | {result['capture_over_floor_per_forward']} |")
    print(f"| local eager forward (ms) | {result['local_eager_ms']} |")
    print(f"| remote forward incl. capture + fetch (ms) | {result['remote_ms']} |")
    print(f"| remote / local (graph_chunk_ops = {chunk_ops}) | {result['remote_over_local']} |")
    print(
        f"| remote unstreamed, one graph (ms; / local) | {result['remote_unstreamed_ms']}; "
        f"{result['remote_unstreamed_over_local']} |"
    )
    if compiled is not None:
        print(
            f"| local torch.compile (inductor) forward (ms; / local eager; compile s) | "
            f"{result['local_compiled_ms']}; {result['local_compiled_over_eager']}; "
            f"{result['compile_s']} |"
        )
    print(
        f"| replayed forward, djinn.replayable (ms; / local) | {result['replayed_ms']}; "
        f"{result['replayed_over_local']} |"
    )
    print(
        f"| replay: client CPU (ms; µs/op); request bytes | {result['replay_client_cpu_ms']}; "
        f"{result['replay_client_us_per_op']}; {request_bytes} |"
    )
    print(f"| max abs diff vs local (captured; replayed) | {diff:.2e}; {replay_diff:.2e} |")
    print(
        f"| transformer alone, its last hidden state (a view) replayed: local ms; "
        f"replayed ms (/ local); max abs diff | {result['local_hidden_ms']}; "
        f"{result['hidden_replayed_ms']} ({result['hidden_replayed_over_local']}); "
        f"{result['hidden_max_abs_diff']:.2e} |"
    )
    print(f"| its replays, recordings, calls run as they are | {result['hidden_stats']} |")
    print(f"| replays, recordings, calls run as they are | {replay_stats} |")
    print(f"| weights upload + first forward (s) | {result['weights_upload_s']} |\n")
    save_json(result, args.json)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
