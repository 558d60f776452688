"""Reading the settings (the table itself: ``djinn.settings``).

Precedence, lowest first: the table's default, ``djinn.toml`` (the file given with
``--config``, else ``$DJINN_CONFIG``, else ``./djinn.toml``), the ``DJINN_*``
environment variable, then CLI flags. ``docs/operations.md`` is generated from the
table (``python -m djinn.config --markdown``) so the reference never drifts.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from djinn import config_rules as rules
from djinn.config_rules import parse_bytes as parse_bytes  # part of this module's API
from djinn.errors import ConfigError
from djinn.settings import SETTINGS as SETTINGS  # part of this module's API
from djinn.settings import Setting as Setting

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

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
