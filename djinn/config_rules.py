"""How a setting's value is read and checked: types, ranges, choices.

The settings table (``config.py``) says *what* each setting is; this module turns a raw
value from a file, the environment or a flag into that type and says, in one line, what
is wrong with it. Every problem is found when the configuration is loaded, so an
operator learns about a bad value from `djinn serve` (exit code 2), not from a worker
that dies at start or a lease that expires after a negative number of seconds.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

from djinn.errors import ConfigError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
UNIX_PATH_MAX = 107  # sun_path holds 108 bytes, one of them the terminating NUL

KIND_WORDS = {
    "str": "text",
    "int": "integer",
    "float": "number",
    "bool": "true or false",
    "bytes": "size",
    "path": "path",
}


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


def human_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g}{unit}" if unit != "B" else f"{n:g}"
        n /= 1024
    return f"{n:g}"  # pragma: no cover


def to_kind(kind: str, value: Any) -> Any:
    """``value`` as ``kind``; ValueError/TypeError with the reason when it is not one."""
    if isinstance(value, (list, dict)):  # a TOML array or table where a scalar belongs
        raise ValueError(f"expected {KIND_WORDS[kind]}, got a {type(value).__name__}")
    if kind == "bool":
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ValueError("expected true or false")
    if kind == "int":
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError("expected an integer")
        return int(str(value).strip()) if isinstance(value, str) else int(value)
    if kind == "float":
        if isinstance(value, bool):
            raise ValueError("expected a number")
        number = float(value)
        if not math.isfinite(number):
            raise ValueError("expected a finite number")
        return number
    if kind == "bytes":
        if str(value).strip().lower() == "auto":
            return "auto"
        try:
            return parse_bytes(value)
        except ConfigError as exc:
            raise ValueError(exc.message) from None
    if kind == "path":
        text = str(value).replace("{uid}", str(os.getuid()))
        return str(Path(text).expanduser()) if text else ""
    return str(value)


def in_range(value: Any, low: float | None, high: float | None, kind: str) -> str | None:
    """A problem with ``value`` against inclusive bounds, or None."""
    if value == "auto" or (low is None and high is None):
        return None
    show = human_size if kind == "bytes" else (lambda v: f"{v:g}")
    if low is not None and value < low:
        return f"must be at least {show(low)}" if high is None else _between(low, high, show)
    if high is not None and value > high:
        return f"must be at most {show(high)}" if low is None else _between(low, high, show)
    return None


def _between(low: float, high: float, show: Any) -> str:
    return f"must be between {show(low)} and {show(high)}"


# -- checks particular to one setting: each returns a problem, or None -----------------------


def check_gpus(value: str) -> str | None:
    spec = value.strip().lower()
    if spec in ("auto", "none", "off", ""):
        return None
    items = [x.strip() for x in spec.split(",") if x.strip()]
    if not all(x.isdigit() for x in items):
        return "must be 'auto', 'none', or GPU indices like '0,1'"
    if len(set(items)) != len(items):
        return "lists a GPU twice"
    return None


def check_address(value: str) -> str | None:
    if not value:
        return None
    from djinn.fleet.address import is_fleet_address, parse_fleet_address
    from djinn.transport.address import parse_address

    try:
        parse_fleet_address(value) if is_fleet_address(value) else parse_address(value)
    except ConfigError as exc:
        return exc.message
    return None


def check_socket_path(value: str) -> str | None:
    if len(os.fsencode(value)) > UNIX_PATH_MAX:
        return f"is longer than a Unix socket path may be ({UNIX_PATH_MAX} bytes)"
    return None


def check_not_empty(value: str) -> str | None:
    return "must not be empty" if not value.strip() else None


def check_methods(value: str) -> str | None:
    for name in (p.strip() for p in value.split(",") if p.strip()):
        # a leading underscore would let clients call private methods or dunders
        if not name.isidentifier() or name.startswith("_"):
            return f"{name!r} is not a public method name"
    return None


RECOVERABLE = ("WORKER_LOST", "SESSION_LOST", "SESSION_EXPIRED")


def check_recovery_errors(value: str) -> str | None:
    for code in (p.strip().upper() for p in value.split(",") if p.strip()):
        if code not in RECOVERABLE:
            return f"{code!r} is not a fault a session recovers from ({', '.join(RECOVERABLE)})"
    return None


def check_memory_policy(value: str) -> str | None:
    """'off' or an installed plugin of djinn.memory_policies (read from metadata only)."""
    from importlib.metadata import entry_points

    names = {ep.name for ep in entry_points(group="djinn.memory_policies")}
    if value == "off" or value in names:
        return None
    return f"no memory policy {value!r} (installed: {', '.join(sorted(names)) or 'none'}, off)"


def check_scheduler(value: str) -> str | None:
    """An installed plugin of djinn.schedulers (read from metadata only)."""
    from importlib.metadata import entry_points

    names = {ep.name for ep in entry_points(group="djinn.schedulers")}
    if value in names:
        return None
    return f"no scheduler {value!r} (installed: {', '.join(sorted(names)) or 'none'})"


def check_placement(value: str) -> str | None:
    """An installed plugin of djinn.placement (read from metadata only)."""
    from importlib.metadata import entry_points

    names = {ep.name for ep in entry_points(group="djinn.placement")}
    if value in names:
        return None
    return f"no placement policy {value!r} (installed: {', '.join(sorted(names)) or 'none'})"


def check_weights(value: str) -> str | None:
    for part in (p.strip() for p in value.split(",") if p.strip()):
        tenant, eq, weight = part.rpartition("=")
        if not eq or not re.fullmatch(
            r"(uid:\d+|host:\S+|token:[A-Za-z0-9_.-]{1,32})", tenant.strip()
        ):
            return f"{part!r} is not tenant=weight (tenant: uid:N, host:ADDR or token:NAME)"
        try:
            w = float(weight)
        except ValueError:
            return f"{part!r}: the weight is not a number"
        if not (w > 0 and math.isfinite(w)):
            return f"{part!r}: the weight must be a positive number"
    return None


def check_together(values: dict[str, Any]) -> str | None:
    """Problems that only a combination of settings has."""
    text, data = values["vmu_text_fraction"], values["vmu_data_fraction"]
    if text + data >= 1:
        return (
            f"vmu_text_fraction + vmu_data_fraction = {text + data:g}: "
            "they must add up to less than 1 to leave room for the stack"
        )
    return None
