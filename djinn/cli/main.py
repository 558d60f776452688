"""`djinn` command: serve, status."""

from __future__ import annotations

import logging
import sys
from typing import Any

import typer

from .flags import with_setting_flags
from .fleet import fleet_app

EXIT_FAILED, EXIT_CONFIG = 1, 2

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Djinn: remote and shared GPUs that feel local to PyTorch programs.",
)


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )


def _exit_for(command: str, exc: Exception) -> typer.Exit:
    """One line on stderr for an error an operator can act on, and the exit code that
    says which kind: 2 for configuration (as `djinn serve` documents), 1 for the rest."""
    from djinn.errors import ConfigError

    typer.echo(f"djinn {command}: {exc}", err=True)
    return typer.Exit(EXIT_CONFIG if isinstance(exc, ConfigError) else EXIT_FAILED)


SET_OPTION = typer.Option(None, "--set", metavar="KEY=VALUE", help="Set any setting (repeatable).")
FLEET_OPTION = typer.Option(
    False, "--fleet", help="Every appliance of a fleet (a fleet:// or ray:// address)."
)
app.add_typer(fleet_app, name="fleet")


def _fleet_target(address: str | None, cfg: Any) -> str:
    """The fleet to show: the address given, else ``address`` if it is a fleet, else the
    Ray cluster this node belongs to."""
    from djinn.fleet.address import is_fleet_address, parse_fleet_address

    target = address or (cfg.address if is_fleet_address(cfg.address) else "fleet://auto")
    parse_fleet_address(target)  # a typo is a one-line error
    return target


@app.command(
    epilog="Every setting is also a flag (the Settings panel); `--set key=value` gives any "
    "of them too. Precedence: defaults < djinn.toml < DJINN_* variables < --set < flags."
)
@with_setting_flags
def serve(
    config: str | None = typer.Option(None, "--config", "-c", help="Path to djinn.toml."),
    assignments: list[str] | None = SET_OPTION,
    parent_pid: int | None = typer.Option(
        None, hidden=True, help="Exit when this process does (embedded)."
    ),
    **settings: Any,
) -> None:
    """Run the appliance: a supervisor and one executor worker per device."""
    from djinn import config as config_mod
    from djinn.errors import DjinnError

    try:
        cfg = config_mod.load(config)
        pairs = [config_mod.parse_assignment(a) for a in assignments or ()]
        for key, value in pairs:
            cfg = cfg.with_overrides(origin=f"--set {key}", **{key: value})
        cfg = cfg.with_overrides(**settings)
    except DjinnError as exc:
        raise _exit_for("serve", exc) from None
    _setup_logging(cfg.log_level)
    from djinn.appliance.supervisor import serve as run_supervisor

    raise typer.Exit(run_supervisor(cfg, parent_pid=parent_pid))


@app.command()
def status(
    address: str | None = typer.Option(None, help="unix:///path or tcp://host:port."),
    token: str | None = typer.Option(None, help="Token for a TCP address."),
    as_json: bool = typer.Option(False, "--json", help="Print the stats document as JSON."),
    config: str | None = typer.Option(None, "--config", "-c", help="Path to djinn.toml."),
    fleet: bool = FLEET_OPTION,
) -> None:
    """Show workers, sessions and memory of a running appliance (--fleet: every
    appliance of a fleet)."""
    from djinn import config as config_mod
    from djinn.errors import DjinnError

    from .status import render

    try:
        cfg = config_mod.load(config)
        if fleet:
            from djinn.fleet.client import FleetClient
            from djinn.fleet.render import render_fleet

            with FleetClient(_fleet_target(address, cfg), token) as fleet_client:
                doc = fleet_client.stats()
            render = render_fleet
        else:
            target = address or cfg.address or f"unix://{cfg.socket_path}"
            if token is None and target.startswith("tcp://"):
                token = config_mod.read_token(cfg)
            from djinn.runtime.client import Client

            with Client(target, token) as client:
                doc = client.stats()
    except DjinnError as exc:
        raise _exit_for("status", exc) from None
    if as_json:
        import json

        typer.echo(json.dumps(doc, indent=2))
    else:
        typer.echo(render(doc))


@app.command()
def top(
    address: str | None = typer.Option(None, help="unix:///path or tcp://host:port."),
    token: str | None = typer.Option(None, help="Token for a TCP address."),
    refresh: float = typer.Option(1.0, min=0.1, help="Seconds between stats polls."),
    config: str | None = typer.Option(None, "--config", "-c", help="Path to djinn.toml."),
    fleet: bool = FLEET_OPTION,
) -> None:
    """Live view of workers, sessions, memory watermarks, models and requests (--fleet:
    a table of every appliance of a fleet)."""
    from djinn import config as config_mod
    from djinn.errors import DjinnError
    from djinn.transport.address import parse_address

    try:
        cfg = config_mod.load(config)
        if fleet:
            target = _fleet_target(address, cfg)
            from djinn.tui.fleet import run_fleet_top

            run_fleet_top(target, token=token, refresh=refresh)
            return
        target = address or cfg.address or f"unix://{cfg.socket_path}"
        parse_address(target)  # a typo is a one-line error here, not a dashboard of it
        if token is None and target.startswith("tcp://"):
            token = config_mod.read_token(cfg)
    except DjinnError as exc:
        raise _exit_for("top", exc) from None
    from djinn.tui.app import run_top

    run_top(target, token=token, refresh=refresh)


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def run(
    ctx: typer.Context,
    script: str = typer.Argument(..., help="The Python script to run, then its arguments."),
    device_map: str = typer.Option(
        "cuda=remote_accelerator", help="Map a device type to the appliance ('' for none)."
    ),
) -> None:
    """Run an unmodified script; its `cuda` work lands on the appliance."""
    from djinn import config as config_mod
    from djinn.errors import DjinnError

    try:  # the script's own clients read the same file: say what is wrong before it runs
        _setup_logging(config_mod.load().log_level)
    except DjinnError as exc:
        raise _exit_for("run", exc) from None
    from .run import run_script

    raise typer.Exit(run_script(script, list(ctx.args), device_map))


@app.command()
def plugins(
    check: bool = typer.Option(
        False, "--check", help="Also import each plugin and report the ones that fail."
    ),
) -> None:
    """List the plugins of every group (from package metadata, nothing imported)."""
    from djinn.semantics.registry import GROUPS, default_registry, list_plugins

    found = list_plugins()
    broken: dict[str, str] = {}
    if check:
        import warnings

        registry = default_registry()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for kind in GROUPS:  # every group: patterns, cost models, policies, schedulers
                registry.load(kind)
        broken = registry.broken
    if not found:
        typer.echo("no plugins registered")
    for p in found:
        key = f"djinn.{p.group}:{p.name}"
        status = f"  BROKEN: {broken[key]}" if key in broken else ("  ok" if check else "")
        typer.echo(f"{p.group:12} {p.name:16} {p.target:52} ({p.distribution}){status}")
    if broken:
        raise typer.Exit(1)


def main() -> None:
    from djinn.errors import DjinnError

    try:
        app()
    except DjinnError as exc:  # whatever a command did not expect: still one line
        command = next((a for a in sys.argv[1:] if not a.startswith("-")), "")
        raise SystemExit(_exit_for(command, exc).exit_code) from None


if __name__ == "__main__":
    main()
