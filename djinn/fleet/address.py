"""Fleet addresses: ``fleet://host:port`` (a Ray cluster's GCS) and ``ray://host:port``.

``fleet://head:6379`` joins the Ray cluster as a driver (the client runs on one of its
nodes); ``fleet://`` or ``fleet://auto`` finds the cluster this node belongs to;
``ray://head:10001`` uses Ray Client, for a machine outside the cluster. Either way the
client asks the fleet's directory which appliance gets each session, then talks to that
appliance over TCP. Pure parsing: no ray here.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from djinn.errors import ConfigError

SCHEMES = ("fleet", "ray")


def is_fleet_address(text: str | None) -> bool:
    return bool(text) and str(text).split("://", 1)[0] in SCHEMES


@dataclass(frozen=True)
class FleetAddress:
    text: str
    ray_address: str  # what ray.init takes

    def __str__(self) -> str:
        return self.text


def parse_fleet_address(text: str) -> FleetAddress:
    parts = urlsplit(text)
    if parts.scheme not in SCHEMES:
        raise ConfigError(f"{text!r}: a fleet address starts with fleet:// or ray://")
    host = parts.netloc
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ConfigError(f"{text!r}: a fleet address is scheme://host:port, nothing after it")
    if parts.scheme == "fleet" and host in ("", "auto"):
        return FleetAddress(text, "auto")
    try:
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"{text!r}: {exc} (fleet://head:6379, ray://head:10001)") from None
    if not parts.hostname or port is None:
        raise ConfigError(f"{text!r}: needs host and port (fleet://head:6379, ray://head:10001)")
    if parts.scheme == "ray":
        return FleetAddress(text, f"ray://{parts.hostname}:{port}")
    return FleetAddress(text, f"{parts.hostname}:{port}")
