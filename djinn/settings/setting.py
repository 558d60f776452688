"""One setting: its key, default, type, bounds and words (``Setting``), and the bounds the
table reuses."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from djinn import config_rules as rules


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
