"""The settings table: one declarative list of every setting Djinn reads.

Precedence, lowest first: the default here, ``djinn.toml`` (the file given with
``--config``, else ``$DJINN_CONFIG``, else ``./djinn.toml``), the ``DJINN_*``
environment variable, then CLI flags. ``docs/operations.md`` is generated from this
table (``python -m djinn.config --markdown``) so the reference never drifts.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from djinn import config_rules as rules
from djinn.config_rules import parse_bytes as parse_bytes  # part of this module's API
from djinn.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@dataclass(frozen=True)
class Setting:
    key: str
    default: Any
    help: str
    kind: str = "str"  # str | int | float | bool | bytes | path
    low: float | None = None  # inclusive bounds for numbers and sizes
    high: float | None = None
    choices: tuple[str, ...] = ()  # the only values a text setting takes (lower case)
    check: Callable[[Any], str | None] | None = None  # any other rule: a problem or None
    shape: str = ""  # what the value looks like, where the type alone does not say

    @property
    def env(self) -> str:
        return "DJINN_" + self.key.upper()

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")

    @property
    def accepts(self) -> str:
        """What values the setting takes, in words (for --help and the reference)."""
        if self.choices:
            return "one of " + ", ".join(self.choices)
        if self.shape:
            return self.shape
        words = rules.KIND_WORDS[self.kind]
        show = rules.human_size if self.kind == "bytes" else (lambda v: f"{v:g}")
        if self.low is not None and self.high is not None:
            words += f", {show(self.low)} to {show(self.high)}"
        elif self.low is not None:
            words += f", at least {show(self.low)}"
        elif self.high is not None:
            words += f", at most {show(self.high)}"
        if self.kind == "bytes" and str(self.default) == "auto":
            words += ", or auto"
        return words


MIB = 1 << 20
PORT = {"low": 0, "high": 65535}
FRACTION = {"low": 0.0, "high": 1.0}

SETTINGS: tuple[Setting, ...] = (
    # -- where the appliance is -----------------------------------------------------
    Setting(
        "address",
        "",
        "Appliance address for clients: unix:///path or tcp://host:port, or a fleet "
        "(djinn fleet): fleet://head:6379 from a node of its Ray cluster, ray://head:10001 "
        "from elsewhere. "
        "Empty: use socket_path if an appliance listens there, else start an embedded one.",
        check=rules.check_address,
        shape="unix:///path, tcp://host:port, fleet://host:port, ray://host:port, or empty",
    ),
    Setting(
        "socket_path",
        "/tmp/djinn-{uid}.sock",
        "Unix socket of the appliance ({uid} is replaced by the user id). Created with "
        "mode 0600. Empty: no Unix socket.",
        "path",
        check=rules.check_socket_path,
        shape="path of at most 107 bytes, or empty",
    ),
    Setting("tcp_enabled", True, "Listen on TCP as well as on the Unix socket.", "bool"),
    Setting(
        "tcp_host",
        "127.0.0.1",
        "TCP bind address. Anything but loopback exposes the "
        "appliance to the network: keep the token secret.",
        check=rules.check_not_empty,
    ),
    Setting(
        "tcp_port",
        7711,
        "TCP port (0 picks a free one; the readiness line shows it).",
        "int",
        **PORT,
    ),
    Setting("token", "", "Shared secret TCP clients must present. Empty: read token_file."),
    Setting(
        "token_file",
        "~/.djinn/token",
        "File holding the token; `djinn serve` creates "
        "it (mode 0600) with a random token when TCP is on and no token is set.",
        "path",
    ),
    # -- workers and memory ---------------------------------------------------------
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
        "runtime's own, 0.58 s brief. The same bits whichever: it is how threads wait, not "
        "how an op's work is split.",
        choices=("brief", "passive", "active", "inherit"),
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
    # -- sessions and lifecycle -----------------------------------------------------
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
    # -- a fleet of appliances on Ray (djinn fleet, issue 13) -------------------------
    Setting(
        "fleet_placement",
        "semantic",
        "Which appliance of a fleet gets a session: a plugin of the djinn.placement group "
        "(built in: semantic, where the model the session registers is resident, else "
        "where it fits best; round_robin, in turn). Read by djinn fleet start.",
        check=rules.check_placement,
        shape="semantic, round_robin or another installed policy",
    ),
    Setting(
        "fleet_report_interval",
        0.5,
        "Seconds between the fleet directory's polls of each appliance (free memory, load, "
        "resident models, liveness) and between a fleet client's checks for dead appliances.",
        "float",
        low=0.05,
        high=60.0,
    ),
    Setting(
        "fleet_appliance_host",
        "",
        "Address each fleet appliance binds its TCP listener to and gives clients. Empty: "
        "the node's address as Ray knows it (reachable from the other nodes: keep the "
        "token secret). Read by djinn fleet start.",
    ),
    # -- watching it ----------------------------------------------------------------
    Setting(
        "stats_window",
        60.0,
        "Seconds of recent requests the stats document's latency percentiles cover "
        "(djinn status, djinn top); Prometheus histograms still count since start.",
        "float",
        low=1.0,
        high=3600.0,
    ),
    Setting(
        "metrics_port",
        0,
        "Prometheus endpoint port on metrics_host (0: no endpoint). "
        "Serves request counts and latency histograms, VMU gauges, sessions, restarts.",
        "int",
        **PORT,
    ),
    Setting(
        "metrics_host",
        "127.0.0.1",
        "Bind address of the Prometheus endpoint.",
        check=rules.check_not_empty,
    ),
    Setting(
        "log_level",
        "warning",
        "Logging level for every Djinn component.",
        choices=("debug", "info", "warning", "error", "critical"),
    ),
)
_BY_KEY = {s.key: s for s in SETTINGS}


def _coerce(setting: Setting, value: Any, origin: str = "") -> Any:
    """``value`` read as the setting's type and checked against its rules; a ConfigError
    naming the setting, the value, where it came from and what is wrong otherwise."""
    where = f" (from {origin})" if origin else ""
    try:
        result = rules.to_kind(setting.kind, value)
    except (TypeError, ValueError) as exc:
        why = str(exc) if setting.kind != "int" else "expected an integer"
        raise ConfigError(f"{setting.key} = {value!r}{where}: {why}") from None
    if setting.choices:
        result = result.strip().lower()
        problem = None if result in setting.choices else f"must be {setting.accepts}"
    elif setting.kind in ("int", "float", "bytes"):
        problem = rules.in_range(result, setting.low, setting.high, setting.kind)
    else:
        problem = None
    if problem is None and setting.check is not None:
        problem = setting.check(result)
    if problem is not None:
        raise ConfigError(f"{setting.key} = {value!r}{where}: {problem}")
    return result


@dataclass
class Config:
    values: dict[str, Any] = field(default_factory=dict)
    source: str = "defaults"

    def __getattr__(self, key: str) -> Any:
        try:
            return self.__dict__["values"][key]
        except KeyError:
            raise AttributeError(key) from None

    def with_overrides(self, *, origin: str = "", **overrides: Any) -> Config:
        """These settings replaced (None: keep), as `djinn serve` flags give them."""
        values = dict(self.values)
        for key, value in overrides.items():
            if value is not None:
                setting = _setting(key, origin or "a flag")
                values[key] = _coerce(setting, value, origin or setting.flag)
        _check_together(values)
        return Config(values, self.source)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.values)


def _setting(key: str, origin: str = "") -> Setting:
    try:
        return _BY_KEY[key]
    except KeyError:
        import difflib

        where = f" in {origin}" if origin else ""
        near = difflib.get_close_matches(key, _BY_KEY, n=1)
        hint = f" (did you mean {near[0]}?)" if near else ""
        raise ConfigError(f"unknown setting {key!r}{where}{hint}") from None


def _check_together(values: dict[str, Any]) -> None:
    problem = rules.check_together(values)
    if problem is not None:
        raise ConfigError(problem)


def parse_assignment(text: str) -> tuple[str, str]:
    """``key=value`` (from ``--set``) as a pair; the key must be a setting."""
    key, sep, value = text.partition("=")
    key = key.strip().replace("-", "_")
    if not sep or not key:
        raise ConfigError(f"--set {text!r}: expected key=value")
    _setting(key, "--set")
    return key, value.strip()


def find_config_file(path: str | os.PathLike | None = None) -> Path | None:
    if path:
        p = Path(path).expanduser()
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        return p
    env = os.environ.get("DJINN_CONFIG")
    if env:
        return find_config_file(env)
    local = Path("djinn.toml")
    return local if local.is_file() else None


def load(path: str | os.PathLike | None = None, *, env: dict[str, str] | None = None) -> Config:
    """Defaults, then the TOML file, then ``DJINN_*`` variables."""
    env = os.environ if env is None else env
    values = {s.key: _coerce(s, s.default) for s in SETTINGS}
    source = "defaults"
    file = find_config_file(path)
    if file is not None:
        try:
            data = tomllib.loads(file.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{file}: not valid TOML: {exc}") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read config file {file}: {exc}") from None
        table = data.get("djinn", data)
        where = str(file.absolute())  # which djinn.toml, when several could be meant
        for key, value in table.items():
            if isinstance(value, dict):
                continue
            values[key] = _coerce(_setting(key, where), value, where)
        source = str(file)
    for s in SETTINGS:
        if s.env in env:
            values[s.key] = _coerce(s, env[s.env], s.env)
    _check_together(values)
    return Config(values, source)


def read_token(cfg: Config) -> str:
    """The configured token, else the token file's content, else ''."""
    if cfg.token:
        return cfg.token
    if cfg.token_file and Path(cfg.token_file).is_file():
        return Path(cfg.token_file).read_text().strip()
    return ""


def markdown_table() -> str:
    rows = ["| key | default | accepts | env | meaning |", "|---|---|---|---|---|"]
    for s in SETTINGS:
        rows.append(f"| `{s.key}` | `{s.default!r}` | {s.accepts} | `{s.env}` | {s.help} |")
    return "\n".join(rows)


if __name__ == "__main__":  # pragma: no cover
    print(markdown_table())
