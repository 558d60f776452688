"""Workers and memory: executors, the arena, device budgets, memory tiers, scheduling.

A section of the settings table (``djinn.settings``)."""

from __future__ import annotations

from djinn import config_rules as rules

from .setting import FRACTION, MIB, Setting

SETTINGS: tuple[Setting, ...] = (
    Setting(
        "gpus",
        "auto",
        "GPUs to use: 'auto' (all NVML sees), 'none', or a list like "
        "'0,1'. One executor worker per GPU.",
        check=rules.check_gpus,
        shape="auto, none, or indices like 0,1",
    ),
    Setting(
        "cpu_workers",
        1,
        "CPU executor workers started when no GPU is used.",
        "int",
        low=1,
        high=256,
    ),
    Setting(
        "cpu_threads",
        0,
        "Threads a CPU worker's torch uses within one op. 0: torch's default, every core "
        "for each worker. With several CPU workers sharing few cores, their share (cores "
        "/ cpu_workers) keeps OpenMP threads from waiting on descheduled siblings: on a "
        "loaded 2-core host a GPT-2 prefill ran 7x faster with 1 thread than with 2.",
        "int",
        low=0,
        high=1024,
    ),
    Setting(
        "cpu_threads_beside_client",
        False,
        "true: a CPU worker runs a graph that a client on this host sent without waiting "
        "for it (it captures the next meanwhile: a training step's forward during its "
        "backward) with one intra-op thread fewer, leaving that client a core; its OpenMP "
        "threads otherwise wait on a sibling sharing a core with it (a 2-core training "
        "loop: 0.70-0.78 s against 0.98 s). Its numbers are then local eager's at that "
        "thread count, not the same script's on this CPU (Note [a capturing client beside "
        "its worker]). false: every graph runs with cpu_threads.",
        "bool",
    ),
    Setting(
        "cpu_wait_policy",
        "brief",
        "How a worker's idle OpenMP threads wait for the next parallel region (Note [idle "
        "OpenMP threads]): brief (they spin about a thousand rounds, then sleep: "
        "GOMP_SPINCOUNT=1000), passive (they sleep at once), active (they spin), or "
        "inherit (the environment's OMP_WAIT_POLICY and GOMP_SPINCOUNT, else the OpenMP "
        "runtime's own: 300,000 rounds). Spinning threads take the cores of the clients "
        "capturing beside the worker: a 2-core training loop took 0.83 s with the "
        "runtime's own, 0.58 s brief. Brief costs a wake-up at each parallel region: a "
        "replayed GPT-2 forward whose client waits idle ran 1.09-1.13x local eager brief, "
        "1.02-1.03x inherit (no other load; a host whose worker has its cores to itself "
        "can set inherit). The same bits whichever: it is how threads wait, not how an "
        "op's work is split.",
        choices=("brief", "passive", "active", "inherit"),
    ),
    Setting(
        "worker_spin_us",
        200.0,
        "Microseconds a worker polls its sockets for the next request after replying, "
        "before it sleeps (Note [spin before sleeping]). Waking a sleeping process can "
        "cost more than a small request's work: on a 2-core VM a HEARTBEAT took about "
        "100 µs with both ends sleeping, 32 µs with both polling. A worker polls only "
        "while its last wait was that short, so an idle one sleeps; never on one core. "
        "0: always sleep.",
        "float",
        low=0.0,
        high=100_000.0,
    ),
    Setting(
        "arena_bytes",
        "1GiB",
        "Size of the shared-memory host arena (bulk tensor "
        "bytes; split evenly between workers). Reserved up front.",
        "bytes",
        low=MIB,
    ),
    Setting(
        "arena_session_max",
        0.5,
        "Most of a worker's arena share one session may hold while others are open "
        "(fraction). Over it, that session's PUT/ALLOC/fetch gets RESOURCE_EXHAUSTED; "
        "others don't.",
        "float",
        low=0.01,
        high=1.0,
    ),
    Setting(
        "arena_reserve",
        0.25,
        "Fraction of a worker's arena share kept for sessions under their fair share "
        "(arena / open sessions): sessions beyond it cannot take these last bytes.",
        "float",
        low=0.0,
        high=0.99,
    ),
    Setting(
        "inline_max_bytes",
        "64KiB",
        "Tensors up to this size travel inside the frame instead of through the arena.",
        "bytes",
        low=0,
        high=64 * MIB,
    ),
    Setting(
        "cpu_worker_memory",
        "auto",
        "Memory a CPU worker's VMU may use (text + data + "
        "stack). 'auto': half of RAM divided between CPU workers.",
        "bytes",
        low=16 * MIB,
    ),
    Setting(
        "gpu_worker_memory",
        "auto",
        "Memory a GPU worker's VMU may use (text + data + stack). 'auto': 90% of the GPU's "
        "free memory when the worker starts (the rest is the CUDA context's and allocator "
        "slack); a size above that is cut to it, with a warning.",
        "bytes",
        low=16 * MIB,
    ),
    Setting(
        "vmu_text_fraction",
        0.0,
        "Optional cap on the share of a device's memory weights (text) may hold; 0: no cap. "
        "Text, data and stack share one budget (issue 9); with vmu_data_fraction, less than 1.",
        "float",
        **FRACTION,
    ),
    Setting(
        "vmu_data_fraction",
        0.0,
        "Optional cap on the share for session data (tensors and KV caches kept between "
        "calls); 0: no cap. These two were fixed splits once (0.4 / 0.4, the rest stack).",
        "float",
        **FRACTION,
    ),
    Setting(
        "memory_policy",
        "semantic",
        "What leaves device memory when it runs short (issue 9): a plugin of the "
        "djinn.memory_policies group (built in: semantic, lru), or 'off' (nothing is "
        "swapped: a request that does not fit is refused).",
        check=rules.check_memory_policy,
        shape="semantic, lru, another installed policy, or off",
    ),
    Setting(
        "admission_timeout",
        10.0,
        "Seconds a model call or op graph that does not fit even after eviction waits for "
        "memory to be freed before RESOURCE_EXHAUSTED (a call may ask for less with "
        "admission_s); 0: refuse at once.",
        "float",
        low=0.0,
        high=600.0,
    ),
    Setting(
        "session_device_max",
        "0",
        "Most device memory one session may hold (its tensors and resident KV caches); "
        "0: no quota. Over it: QUOTA_EXCEEDED.",
        "bytes",
        low=0,
    ),
    Setting(
        "session_host_max",
        "0",
        "Most host-arena memory one session may hold (its arena slabs and its KV caches "
        "swapped out to the host); 0: no quota. Over it: QUOTA_EXCEEDED.",
        "bytes",
        low=0,
    ),
    Setting(
        "tenant_device_max",
        "0",
        "Most device memory all open sessions of one tenant (a tenant token's holder, a "
        "Unix user, a TCP client's address) may hold on one worker; 0: no quota. Over it: "
        "QUOTA_EXCEEDED (Note [tenant quotas]).",
        "bytes",
        low=0,
    ),
    Setting(
        "tenant_host_max",
        "0",
        "Most host-arena memory all open sessions of one tenant may hold on one worker "
        "(slabs, and KV caches and tensors swapped out); 0: no quota. Over it: "
        "QUOTA_EXCEEDED.",
        "bytes",
        low=0,
    ),
    Setting(
        "kv_recompute",
        "auto",
        "What happens to a KV cache the memory policy evicts (Note [kv recompute]): 'auto' "
        "drops it and recomputes it from its recorded tokens when that prefill is cheaper "
        "than copying it back (measured on the worker), or when the host tier has no room, "
        "and swaps it otherwise; 'always' recomputes whenever it can; 'never' always swaps.",
        choices=("auto", "always", "never"),
    ),
    Setting(
        "scheduler",
        "semantic",
        "What runs next on a worker (issue 10): a plugin of the djinn.schedulers group "
        "(built in: semantic, which puts decode steps and small graphs ahead of prefills "
        "and training steps and shares the rest fairly; fifo, arrival order).",
        check=rules.check_scheduler,
        shape="semantic, fifo or another installed scheduler",
    ),
    Setting(
        "scheduler_slice_ms",
        5.0,
        "How long a worker runs one request before it reads its sockets and lets the "
        "scheduler choose again; a graph is set aside between two ops, a single op runs "
        "to its end.",
        "float",
        low=0.1,
        high=10_000.0,
    ),
    Setting(
        "scheduler_small_graph",
        64,
        "A graph of at most this many ops is interactive work for the semantic scheduler "
        "(an eager op, a sampling step); longer ones are throughput work.",
        "int",
        low=1,
        high=1_000_000,
    ),
    Setting(
        "scheduler_max_wait_ms",
        500.0,
        "Ageing: a request waiting longer than this is treated as interactive, so "
        "throughput work never starves.",
        "float",
        low=1.0,
        high=3_600_000.0,
    ),
    Setting(
        "scheduler_weights",
        "",
        "Fair-share weights of tenants, as tenant=weight pairs separated by commas: "
        "uid:1000=2 (a Unix user), host:10.0.0.7=0.5 (a TCP client's address), "
        "token:alice=3 (a TCP client presenting alice's token from tenant_tokens_file). "
        "Tenants not listed weigh 1.",
        check=rules.check_weights,
        shape="tenant=weight, ... (uid:N, host:ADDR or token:NAME, weights > 0)",
    ),
    Setting(
        "tenant_tokens_file",
        "",
        "File of 'name token' lines (mode 0600; tokens of 16 characters or more): a TCP "
        "client presenting one of these tokens instead of `token` is let in as tenant "
        "token:NAME, for fair shares (scheduler_weights). Empty: none.",
    ),
    Setting(
        "batch_max",
        8,
        "Most decode steps of one model, from different sessions, that a worker runs as "
        "one batched forward (Note [cross-session batching]); 1 turns batching off.",
        "int",
        low=1,
        high=256,
    ),
    Setting(
        "batch_wait_us",
        2000,
        "How long a decode step may wait for the steps of other sessions that decode the "
        "same model (those that did within the last second) so that they run as one batch.",
        "int",
        low=0,
        high=1_000_000,
    ),
    Setting(
        "model_roots",
        "~/.cache/djinn/models",
        "Directories the appliance may load "
        "model weights from (safetensors only), separated by ':'. A path outside them, "
        "or reaching outside through '..' or a symlink, is refused.",
    ),
    Setting(
        "model_allowlist",
        "transformers.",
        "Module prefixes whose classes the "
        "appliance may build for the model path (comma-separated). Other modules run on "
        "the graph path.",
    ),
    Setting(
        "model_methods",
        "generate",
        "Methods besides forward that clients may call on a registered model "
        "(comma-separated; names starting with _ are refused).",
        check=rules.check_methods,
        shape="comma-separated method names",
    ),
    Setting(
        "prewarm",
        True,
        "Once a worker is ready, import the model code of the allowlisted packages in the "
        "background (transformers' shared modules), so the first registration does not "
        "pay for it (about 5 s). Off: imported by the first registration.",
        "bool",
    ),
)
