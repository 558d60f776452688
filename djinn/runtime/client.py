"""Client: the entry point to an appliance (``djinn.connect``)."""

from __future__ import annotations

import os
import socket
import warnings
from typing import Any

from djinn import config as config_mod
from djinn.errors import DjinnError, Unavailable
from djinn.fleet.address import is_fleet_address
from djinn.protocol.frames import Kind
from djinn.transport.address import Address, parse_address
from djinn.transport.arena import ArenaMapping

from .channel import Channel


def _lost(why: str) -> DjinnError:
    return Unavailable(f"lost the connection to the appliance: {why}")


class Client:
    """A connection to one appliance. Cheap to keep; open sessions to hold tensors."""

    def __init__(
        self, address: str, token: str | None = None, *, spin_us: float | None = None
    ) -> None:
        self.address: Address = parse_address(address)
        self.token = token
        # Note [spin before sleeping]: how long its channels poll for a reply (None: the
        # client_spin_us setting)
        cfg = config_mod.load()
        self.spin_us = cfg.client_spin_us if spin_us is None else spin_us
        self.follow_ahead: str = cfg.follow_ahead  # Note [steps followed while the graph runs]
        self.replay_ahead: str = cfg.replay_ahead  # Note [replays sent ahead]
        self._arenas: dict[str, ArenaMapping] = {}
        self._ctl = Channel(self.address, _lost, self.spin_us)
        self.server = self._ctl.hello(token)

    def session(self, *, recover: bool = False) -> Any:
        """A new session (a context manager); everything it holds is freed when it ends.
        ``recover=True``: when its worker is lost the session is rebuilt on another and
        what it held is replayed there (Note [lineage journal], the ``recovery_*``
        settings); otherwise its requests fail with WORKER_LOST, then SESSION_LOST."""
        from .session import Session

        return Session(self, recover=recover)

    def stats(self) -> dict[str, Any]:
        """The stats document (same as ``djinn status --json``)."""
        return self._ctl.call(Kind.STATS).body

    def kill_session(self, session_id: str) -> bool:
        """End another session (operator action); True if it existed."""
        return bool(self._ctl.call(Kind.KILL_SESSION, {"session": session_id}).body["killed"])

    def ping(self) -> None:
        self._ctl.call(Kind.PING)

    def _map_arena(self, info: dict[str, Any]) -> ArenaMapping:
        arena = self._arenas.get(info["name"])
        if arena is None:
            # An appliance has one arena, so another name means it restarted (a session
            # rebuilt on the new one, Note [lineage journal]): the old segment is unlinked,
            # and this mapping was all that kept its pages allocated.
            for gone in self._arenas.values():
                gone.close()
            self._arenas = {info["name"]: ArenaMapping(info["name"], info["size"])}
            arena = self._arenas[info["name"]]
        return arena

    def close(self) -> None:
        self._ctl.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Client({self.address})"


def _listening(path: str) -> bool:
    if not path or not os.path.exists(path):
        return False
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
        return True
    except OSError:
        return False
    finally:
        probe.close()


def resolve_address(address: str | None, cfg: config_mod.Config) -> str:
    """Argument, then DJINN_ADDRESS / djinn.toml ``address``, then a local appliance on
    ``socket_path``, then an embedded appliance started for this process."""
    if address:
        return address
    if cfg.address:
        return cfg.address
    if _listening(cfg.socket_path):
        return f"unix://{cfg.socket_path}"
    from .embedded import embedded_address

    found = config_mod.find_config_file()
    return embedded_address(cfg.embedded_start_timeout, str(found) if found else None)


def connect(address: str | None = None, *, token: str | None = None) -> Client:
    """Connect to an appliance (``unix:///path`` or ``tcp://host:port``), or to a fleet
    (``fleet://head:6379``, ``ray://head:10001``: a ``FleetClient``, which places each
    session on one of its appliances).

    With no address anywhere, an embedded appliance is started for this process and
    stopped when it exits. ``token`` defaults to DJINN_TOKEN / token / token_file.
    """
    cfg = config_mod.load()
    target = resolve_address(address, cfg)
    if token is None and target.startswith("tcp://"):
        token = config_mod.read_token(cfg)
    try:
        if is_fleet_address(target):  # issue 13: one appliance of a fleet per session
            from djinn.fleet.client import FleetClient

            return FleetClient(target, token)
        return Client(target, token)
    except Unavailable as exc:
        if address is not None:
            raise  # the caller named this appliance: no other will do
        if cfg.fallback != "local":
            raise Unavailable(
                f"{exc.message}. Start one with `djinn serve`, point DJINN_ADDRESS (or "
                "address in djinn.toml) at a running one, or unset it to have an embedded "
                'one started for this program; fallback = "local" does that when the '
                "configured one is unreachable."
            ) from None
    # Capability interlock (issue 12 §4): the program runs on this machine instead
    warnings.warn(
        f"djinn: the appliance at {target} cannot be reached; running on this machine "
        "(fallback = local)",
        RuntimeWarning,
        stacklevel=2,
    )
    from .embedded import embedded_address

    found = config_mod.find_config_file()
    return Client(embedded_address(cfg.embedded_start_timeout, str(found) if found else None))
