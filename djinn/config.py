"""The settings table: one declarative list of every setting Djinn reads.

Precedence, lowest first: the default here, ``djinn.toml`` (the file given with
``--config``, else ``$DJINN_CONFIG``, else ``./djinn.toml``), the ``DJINN_*``
environment variable, then CLI flags. ``docs/operations.md`` is generated from this
table (``python -m djinn.config --markdown``) so the reference never drifts.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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

    @property
    def env(self) -> str:
        return "DJINN_" + self.key.upper()


SETTINGS: tuple[Setting, ...] = (
    # -- where the appliance is -----------------------------------------------------
    Setting(
        "address",
        "",
        "Appliance address for clients: unix:///path or tcp://host:port. "
        "Empty: use socket_path if an appliance listens there, else start an embedded one.",
    ),
    Setting(
        "socket_path",
        "/tmp/djinn-{uid}.sock",
        "Unix socket of the appliance ({uid} is replaced by the user id). Created with mode 0600.",
        "path",
    ),
    Setting("tcp_enabled", True, "Listen on TCP as well as on the Unix socket.", "bool"),
    Setting(
        "tcp_host",
        "127.0.0.1",
        "TCP bind address. Anything but loopback exposes the "
        "appliance to the network: keep the token secret.",
    ),
    Setting("tcp_port", 7711, "TCP port (0 picks a free one; the readiness line shows it).", "int"),
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
    ),
    Setting("cpu_workers", 1, "CPU executor workers started when no GPU is used.", "int"),
    Setting(
        "arena_bytes",
        "1GiB",
        "Size of the shared-memory host arena (bulk tensor "
        "bytes; split evenly between workers). Reserved up front.",
        "bytes",
    ),
    Setting(
        "arena_session_max",
        0.5,
        "Most of a worker's arena share one session may hold while others are open "
        "(fraction). Over it, that session's PUT/ALLOC/fetch gets RESOURCE_EXHAUSTED; "
        "others don't.",
        "float",
    ),
    Setting(
        "arena_reserve",
        0.25,
        "Fraction of a worker's arena share kept for sessions under their fair share "
        "(arena / open sessions): sessions beyond it cannot take these last bytes.",
        "float",
    ),
    Setting(
        "inline_max_bytes",
        "64KiB",
        "Tensors up to this size travel inside the frame instead of through the arena.",
        "bytes",
    ),
    Setting(
        "cpu_worker_memory",
        "auto",
        "Memory a CPU worker's VMU may use (text + data + "
        "stack). 'auto': half of RAM divided between CPU workers.",
        "bytes",
    ),
    Setting("vmu_text_fraction", 0.4, "Share of a device's memory for weights (text).", "float"),
    Setting(
        "vmu_data_fraction",
        0.4,
        "Share for session data: tensors and KV caches kept "
        "between calls (data). The rest is stack (activations during a call).",
        "float",
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
        "Methods besides forward that clients may call on a registered model (comma-separated).",
    ),
    # -- sessions and lifecycle -----------------------------------------------------
    Setting("heartbeat_interval", 1.0, "Seconds between client heartbeats.", "float"),
    Setting(
        "heartbeat_misses",
        3,
        "Missed heartbeats before a session's lease expires and its handles and slabs are freed.",
        "int",
    ),
    Setting("drain_timeout", 5.0, "Seconds SIGTERM waits for in-flight requests.", "float"),
    Setting(
        "restart_backoff_max",
        30.0,
        "Longest wait before restarting a worker that "
        "keeps crashing (the wait doubles from 0.5 s per quick crash).",
        "float",
    ),
    Setting(
        "restart_backoff_reset",
        60.0,
        "Seconds a worker must stay healthy (ready) for its crash-loop back-off to be "
        "forgiven: its next death restarts it after 0.5 s again.",
        "float",
    ),
    Setting(
        "embedded_start_timeout",
        60.0,
        "Seconds a client waits for an embedded appliance to become ready.",
        "float",
    ),
    Setting(
        "metrics_port",
        0,
        "Prometheus endpoint port on metrics_host (0: no endpoint). "
        "Serves request counts and latency histograms, VMU gauges, sessions, restarts.",
        "int",
    ),
    Setting("metrics_host", "127.0.0.1", "Bind address of the Prometheus endpoint."),
    Setting("log_level", "warning", "Logging level for every Djinn component."),
)
_BY_KEY = {s.key: s for s in SETTINGS}

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_bytes(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ConfigError(f"size must be non-negative, got {value}")
        return value
    m = _SIZE.match(str(value))
    if not m:
        raise ConfigError(f"not a size: {value!r} (try 512MiB, 2GiB, 1048576)")
    unit = (m.group(2) or "").upper().replace("I", "").replace("B", "")
    return int(float(m.group(1)) * _UNITS[unit])


def _coerce(setting: Setting, value: Any) -> Any:
    kind = setting.kind
    try:
        if kind == "bool":
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if kind == "int":
            return int(value)
        if kind == "float":
            return float(value)
        if kind == "bytes":
            return "auto" if str(value) == "auto" else parse_bytes(value)
        if kind == "path":
            text = str(value).replace("{uid}", str(os.getuid()))
            return str(Path(text).expanduser()) if text else ""
        return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{setting.key}: cannot use {value!r} as {kind}") from None


@dataclass
class Config:
    values: dict[str, Any] = field(default_factory=dict)
    source: str = "defaults"

    def __getattr__(self, key: str) -> Any:
        try:
            return self.__dict__["values"][key]
        except KeyError:
            raise AttributeError(key) from None

    def with_overrides(self, **overrides: Any) -> Config:
        values = dict(self.values)
        for key, value in overrides.items():
            if value is not None:
                values[key] = _coerce(_setting(key), value)
        return Config(values, self.source)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.values)


def _setting(key: str) -> Setting:
    try:
        return _BY_KEY[key]
    except KeyError:
        raise ConfigError(f"unknown setting {key!r}") from None


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
            raise ConfigError(f"{file}: {exc}") from None
        table = data.get("djinn", data)
        for key, value in table.items():
            if isinstance(value, dict):
                continue
            values[key] = _coerce(_setting(key), value)
        source = str(file)
    for s in SETTINGS:
        if s.env in env:
            values[s.key] = _coerce(s, env[s.env])
    return Config(values, source)


def read_token(cfg: Config) -> str:
    """The configured token, else the token file's content, else ''."""
    if cfg.token:
        return cfg.token
    if cfg.token_file and Path(cfg.token_file).is_file():
        return Path(cfg.token_file).read_text().strip()
    return ""


def markdown_table() -> str:
    rows = ["| key | default | env | meaning |", "|---|---|---|---|"]
    for s in SETTINGS:
        rows.append(f"| `{s.key}` | `{s.default!r}` | `{s.env}` | {s.help} |")
    return "\n".join(rows)


if __name__ == "__main__":  # pragma: no cover
    print(markdown_table())
