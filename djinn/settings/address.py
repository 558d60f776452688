"""Where the appliance is: its address, sockets, TCP and token.

A section of the settings table (``djinn.settings``)."""

from __future__ import annotations

from djinn import config_rules as rules

from .setting import PORT, Setting

SETTINGS: tuple[Setting, ...] = (
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
)
