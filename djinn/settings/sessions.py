"""Sessions and their lifecycle: leases, limits, recovery, quotas.

A section of the settings table (``djinn.settings``)."""

from __future__ import annotations

from djinn import config_rules as rules

from .setting import Setting

SETTINGS: tuple[Setting, ...] = (
    Setting(
        "heartbeat_interval",
        1.0,
        "Seconds between client heartbeats.",
        "float",
        low=0.05,
        high=3600.0,
    ),
    Setting(
        "heartbeat_misses",
        3,
        "Missed heartbeats before a session's lease expires and its handles and slabs are freed.",
        "int",
        low=1,
        high=1000,
    ),
    Setting(
        "drain_timeout",
        5.0,
        "Seconds SIGTERM waits for in-flight requests.",
        "float",
        low=0.0,
        high=3600.0,
    ),
    Setting(
        "restart_backoff_max",
        30.0,
        "Longest wait before restarting a worker that "
        "keeps crashing (the wait doubles from 0.5 s per quick crash).",
        "float",
        low=0.5,
        high=3600.0,
    ),
    Setting(
        "restart_backoff_reset",
        60.0,
        "Seconds a worker must stay healthy (ready) for its crash-loop back-off to be "
        "forgiven: its next death restarts it after 0.5 s again.",
        "float",
        low=0.0,
        high=86400.0,
    ),
    Setting(
        "embedded_start_timeout",
        60.0,
        "Seconds a client waits for an embedded appliance to become ready.",
        "float",
        low=1.0,
        high=3600.0,
    ),
    Setting(
        "client_spin_us",
        200.0,
        "Microseconds a client polls for a reply before it sleeps (Note [spin before "
        "sleeping]; the worker's side is worker_spin_us). It polls only for a kind of "
        "request whose last reply came that quickly, so a long EXEC costs one window, "
        "then none; never on one core. 0: always sleep.",
        "float",
        low=0.0,
        high=100_000.0,
    ),
    Setting(
        "follow_ahead",
        "auto",
        "When a replayed training call's optimizer steps are followed (Note [followed "
        "steps]): always, send the part before the steps as the call starts, so the worker "
        "runs the forward and backward while the client follows the steps, then the steps "
        "as a graph of their own; never, send the whole call as one graph once the steps "
        "were followed; auto, always unless the worker is a CPU worker whose threads take "
        "every core of the client's host (where the overlap measured slower).",
        choices=("auto", "always", "never"),
    ),
    Setting(
        "replay_ahead",
        "auto",
        "When a replayed call is sent (Note [replays sent ahead]): always, while the graph "
        "before it still runs on the worker, which starts it as soon as that one ends (a "
        "failure of that graph is then raised a call later, and the replayed call's "
        "results hold it); never, once that graph's reply was read; auto, always unless "
        "the worker is a CPU worker whose threads take every core of the client's host "
        "(where the overlap measured no faster).",
        choices=("auto", "always", "never"),
    ),
    Setting(
        "graph_chunk_ops",
        4096,
        "A thread that has captured this many ops without needing a value sends them to "
        "the appliance without waiting (Note [streamed graphs]). This bounds the graph a "
        "loop that never reads a value builds (an appliance takes at most 100,000 ops a "
        "graph); the default leaves a model's forward whole, which measures fastest on a "
        "CPU worker. 0: a graph is sent only when a value is needed.",
        "int",
        low=0,
        high=100_000,
    ),
    Setting(
        "graph_plan_after",
        2,
        "Runs of one graph template (a repeated forward, training or optimizer step) a "
        "worker interprets op by op, every check included, before it records an execution "
        "plan of it; later runs with inputs of the same shapes, strides and dtypes run the "
        "plan: the same kernels without decoding or re-checking each op (Note [graph "
        "plans]). 0: never.",
        "int",
        low=0,
        high=1_000_000,
    ),
    Setting(
        "graph_compile_after",
        1,
        "Runs of one execution plan (graph_plan_after) before the worker compiles it: the "
        "plan's ops written out as one Python function that calls each kernel directly, "
        "with the stack reserved once per run instead of per op; the same kernels on the "
        "same arguments, so the same results (Note [compiled plans]). A plan that cannot be "
        "compiled runs as a plan, and the stats count it. 0: never.",
        "int",
        low=0,
        high=1_000_000,
    ),
    Setting(
        "cuda_graphs",
        True,
        "On a GPU worker, replay a compiled plan that qualifies as one CUDA graph: its "
        "kernels launched by one call instead of one Python call each, the same bits "
        "(Note [CUDA graphs for plans]). A plan that writes into its inputs (a training "
        "step) writes them where they are (captured again when they move). Plans that "
        "draw random numbers or read values to check them stay compiled; the stats count "
        "each, and why. No effect on CPU workers.",
        "bool",
    ),
    Setting(
        "cuda_graph_bytes",
        "1GiB",
        "Most GPU memory a worker's CUDA graphs may keep together (each keeps what its run "
        "allocated, outside the VMU's account); the least recently replayed goes first, "
        "and a plan whose run needs more is never captured.",
        "bytes",
        low=0,
    ),
    Setting(
        "fallback",
        "error",
        "What a client does when the appliance it is configured to use (address, "
        "DJINN_ADDRESS) cannot be reached: error (UNAVAILABLE, saying how to start or "
        "reach one) or local (start an embedded appliance on this machine, on its CPU or "
        "its own GPU, with one warning).",
        choices=("error", "local"),
    ),
    Setting(
        "client_gc_threshold",
        10_000,
        "When a client's first default session opens, it raises Python's young-generation "
        "collection threshold (gc.set_threshold's first value, 700 in CPython 3.11) to this, "
        "never lowering one the program set: capture keeps many objects alive until their "
        "graph is sent, and at 700 they were promoted fast enough to trigger a full "
        "collection, walking every object of the program (150 ms), every ~20 steps of a small "
        "training loop (Note [collector pace]). 0: the collector is left as it is.",
        "int",
        low=0,
        high=10_000_000,
    ),
    Setting(
        "recovery_retries",
        3,
        "How many times a client rebuilds its default session after its worker (or the "
        "whole appliance) was lost, replaying what the program holds there (Note [lineage "
        "journal]), before it gives up with RECOVERY_FAILED naming the original fault. "
        "0: no recovery (the lost session's tensors raise SESSION_LOST).",
        "int",
        low=0,
        high=100,
    ),
    Setting(
        "recovery_backoff",
        0.2,
        "Seconds before the second attempt to rebuild a lost session; doubles with each "
        "further attempt, up to recovery_backoff_max.",
        "float",
        low=0.0,
        high=60.0,
    ),
    Setting(
        "recovery_backoff_max",
        2.0,
        "Longest wait between two attempts to rebuild a lost session.",
        "float",
        low=0.0,
        high=300.0,
    ),
    Setting(
        "recovery_errors",
        "WORKER_LOST,SESSION_LOST",
        "The faults after which a client rebuilds its session and sends the request again "
        "(comma-separated codes among WORKER_LOST, SESSION_LOST, SESSION_EXPIRED). An "
        "operator's SESSION_ENDED is never undone.",
        check=rules.check_recovery_errors,
        shape="comma-separated error codes",
    ),
    Setting(
        "recovery_checkpoint_bytes",
        "64MiB",
        "How much a recovering session's journal may grow before it is cut back to a "
        "snapshot of the live values (Note [lineage truncation]): the client's memory for "
        "recovery stays below the live values plus this.",
        "bytes",
        low=1 << 20,
    ),
    Setting(
        "recovery_checkpoint_seconds",
        1.0,
        "The journal is also cut when replaying what it recorded since the last cut would "
        "take longer than this (as those requests took) and than the last cut took: the "
        "replay part of a recovery stays about this long.",
        "float",
        low=0.01,
        high=3600.0,
    ),
    Setting(
        "recovery_standby",
        False,
        "Keep a recovering session's registered models on a second worker as well (Note "
        "[warm standby]), so that a recovery finds them there instead of uploading them "
        "again: faster recoveries for one more copy of the models in the appliance.",
        "bool",
    ),
    Setting(
        "recovery_kv",
        "prefill",
        "How a recovery rebuilds a live KV cache (Note [kv prefill replay]): prefill (its "
        "decode steps as one forward of their tokens: a few calls, the cache equal to "
        "float rounding) or steps (every decode step replayed as it ran: bit-exact, one "
        "forward per token).",
        choices=("prefill", "steps"),
    ),
)
