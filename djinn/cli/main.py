"""`djinn` command: serve, status."""

from __future__ import annotations

import logging
import sys

import typer

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


@app.command()
def serve(
    config: str | None = typer.Option(None, "--config", "-c", help="Path to djinn.toml."),
    socket_path: str | None = typer.Option(None, "--socket", help="Unix socket path."),
    tcp_host: str | None = typer.Option(None, help="TCP bind address."),
    tcp_port: int | None = typer.Option(None, help="TCP port (0: any free port)."),
    no_tcp: bool = typer.Option(False, "--no-tcp", help="Listen on the Unix socket only."),
    cpu_workers: int | None = typer.Option(None, help="CPU workers when no GPU is used."),
    gpus: str | None = typer.Option(None, help="'auto', 'none' or a list like '0,1'."),
    arena_bytes: str | None = typer.Option(None, help="Host arena size, e.g. 2GiB."),
    log_level: str | None = typer.Option(None, help="debug, info, warning, error."),
    parent_pid: int | None = typer.Option(
        None, hidden=True, help="Exit when this process does (embedded)."
    ),
) -> None:
    """Run the appliance: a supervisor and one executor worker per device."""
    from djinn import config as config_mod
    from djinn.errors import DjinnError

    try:
        cfg = config_mod.load(config).with_overrides(
            socket_path=socket_path,
            tcp_host=tcp_host,
            tcp_port=tcp_port,
            tcp_enabled=False if no_tcp else None,
            cpu_workers=cpu_workers,
            gpus=gpus,
            arena_bytes=arena_bytes,
            log_level=log_level,
        )
    except DjinnError as exc:
        typer.echo(f"djinn serve: {exc}", err=True)
        raise typer.Exit(2) from None
    _setup_logging(cfg.log_level)
    from djinn.appliance.supervisor import serve as run_supervisor

    raise typer.Exit(run_supervisor(cfg, parent_pid=parent_pid))


@app.command()
def status(
    address: str | None = typer.Option(None, help="unix:///path or tcp://host:port."),
    token: str | None = typer.Option(None, help="Token for a TCP address."),
    as_json: bool = typer.Option(False, "--json", help="Print the stats document as JSON."),
    config: str | None = typer.Option(None, "--config", "-c", help="Path to djinn.toml."),
) -> None:
    """Show workers, sessions and memory of a running appliance."""
    from djinn import config as config_mod
    from djinn.errors import DjinnError

    from .status import render

    try:
        cfg = config_mod.load(config)
        target = address or cfg.address or f"unix://{cfg.socket_path}"
        if token is None and target.startswith("tcp://"):
            token = config_mod.read_token(cfg)
        from djinn.runtime.client import Client

        with Client(target, token) as client:
            doc = client.stats()
    except DjinnError as exc:
        typer.echo(f"djinn status: {exc}", err=True)
        raise typer.Exit(1) from None
    if as_json:
        import json

        typer.echo(json.dumps(doc, indent=2))
    else:
        typer.echo(render(doc))


@app.command()
def top(
    address: str | None = typer.Option(None, help="unix:///path or tcp://host:port."),
    token: str | None = typer.Option(None, help="Token for a TCP address."),
    refresh: float = typer.Option(1.0, help="Seconds between stats polls."),
    config: str | None = typer.Option(None, "--config", "-c", help="Path to djinn.toml."),
) -> None:
    """Live view of workers, sessions, memory watermarks, models and requests."""
    from djinn import config as config_mod

    cfg = config_mod.load(config)
    target = address or cfg.address or f"unix://{cfg.socket_path}"
    if token is None and target.startswith("tcp://"):
        token = config_mod.read_token(cfg)
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

    _setup_logging(config_mod.load().log_level)
    from .run import run_script

    raise typer.Exit(run_script(script, list(ctx.args), device_map))


@app.command()
def plugins(
    check: bool = typer.Option(
        False, "--check", help="Also import each plugin and report the ones that fail."
    ),
) -> None:
    """List the pattern and cost-model plugins (from package metadata, nothing imported)."""
    from djinn.semantics.registry import default_registry, list_plugins

    found = list_plugins()
    broken: dict[str, str] = {}
    if check:
        import warnings

        registry = default_registry()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            registry.patterns()
            registry.cost_models()
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
    app()


if __name__ == "__main__":
    main()
