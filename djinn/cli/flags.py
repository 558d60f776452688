"""`djinn serve`'s setting flags, generated from the settings table (djinn/config.py).

Every setting is a flag named after its key (``tcp_port`` -> ``--tcp-port``); booleans
take ``--key/--no-key``. The table is the only list: adding a setting adds its flag, its
``--help`` line and its reference row. Typer reads a command's parameters from its
signature, so the generated options are added to the signature of a function that takes
them as ``**settings``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import typer

from djinn.config import SETTINGS, Setting

PANEL = "Settings (override djinn.toml and DJINN_* variables)"
# Flags that existed before every setting had one; kept so scripts keep working.
ALIASES = {"socket_path": ("--socket",)}
OFF_FLAGS = {"tcp_enabled": "--no-tcp"}
METAVAR = {"int": "INT", "float": "NUM", "bytes": "SIZE", "path": "PATH", "str": "TEXT"}


def _option(s: Setting) -> Any:
    text = f"{s.help} Accepts {s.accepts}; default {s.default!r}; env {s.env}."
    common = {"help": text, "rich_help_panel": PANEL, "show_default": False}
    if s.kind == "bool":
        off = OFF_FLAGS.get(s.key, "--no-" + s.flag[2:])
        return typer.Option(None, f"{s.flag}/{off}", **common)
    return typer.Option(None, s.flag, *ALIASES.get(s.key, ()), metavar=METAVAR[s.kind], **common)


def with_setting_flags(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Give ``fn(..., **settings)`` one keyword option per setting, for typer to read."""
    sig = inspect.signature(fn)
    params = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
    taken = {p.name for p in params}
    annotations = dict(fn.__annotations__)
    for s in SETTINGS:
        assert s.key not in taken, f"setting {s.key} clashes with a serve parameter"
        hint = bool | None if s.kind == "bool" else str | None
        params.append(inspect.Parameter(s.key, inspect.Parameter.KEYWORD_ONLY, default=_option(s)))
        params[-1] = params[-1].replace(annotation=hint)
        annotations[s.key] = hint
    fn.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    fn.__annotations__ = annotations
    return fn
