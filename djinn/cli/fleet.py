"""`djinn fleet`: start, join and stop a fleet of appliances on Ray (issue 13).

Thin commands over ``djinn.fleet.cluster``; ray is imported inside each command, so
`djinn --help` and every other command work without the ``[fleet]`` extra.
"""

from __future__ import annotations

import typer

fleet_app = typer.Typer(
    no_args_is_help=True,
    help="A fleet of appliances on Ray: one `djinn serve` per node, one client view.",
)

CONFIG_OPTION = typer.Option(None, "--config", "-c", help="Path to djinn.toml.")
SET_OPTION = typer.Option(None, "--set", metavar="KEY=VALUE", help="Set any setting (repeatable).")
APPLIANCE_OPTION = typer.Option(
    True, "--appliance/--no-appliance", help="Run an appliance on this node."
)


def _fail(command: str, exc: Exception) -> typer.Exit:
    from .main import _exit_for

    return _exit_for(f"fleet {command}", exc)


def _config(config: str | None, assignments: list[str] | None) -> object:
    from djinn import config as config_mod

    cfg = config_mod.load(config)
    for key, value in (config_mod.parse_assignment(a) for a in assignments or ()):
        cfg = cfg.with_overrides(origin=f"--set {key}", **{key: value})
    return cfg


@fleet_app.command()
def start(
    port: int = typer.Option(6379, help="Port of the Ray head this starts."),
    address: str | None = typer.Option(
        None, help="Use the running Ray cluster at host:port instead of starting a head."
    ),
    appliance: bool = APPLIANCE_OPTION,
    num_cpus: int | None = typer.Option(None, help="CPUs this node offers to Ray."),
    num_gpus: int | None = typer.Option(None, help="GPUs this node offers (default: all)."),
    wait: int = typer.Option(0, help="Wait until this many appliances are up."),
    config: str | None = CONFIG_OPTION,
    assignments: list[str] | None = SET_OPTION,
) -> None:
    """Start a Ray head on this node (or use a running cluster) and the fleet directory.

    Every setting except the fleet_* ones is handed to each appliance, as `djinn serve`
    would read it; the appliances' token is this machine's (token, else token_file)."""
    from djinn.errors import DjinnError

    try:
        cfg = _config(config, assignments)
        from djinn.appliance.listeners import ensure_token
        from djinn.fleet import cluster

        if address is None:
            code = cluster.ray_start(
                head=True, port=port, appliance=appliance, num_cpus=num_cpus, num_gpus=num_gpus
            )
            if code != 0:
                raise typer.Exit(1)
        target = address or f"127.0.0.1:{port}"
        cluster.connect_ray(target)
        token = ensure_token(cfg.token, cfg.token_file)
        cluster.start_directory(cfg.to_dict(), token, detached=True)
        typer.echo(
            f"djinn fleet: directory up (placement {cfg.fleet_placement}); every node "
            f'offering djinn_appliance runs an appliance. Clients: address = "fleet://{target}"'
        )
        if wait:
            from djinn.fleet.render import render_fleet

            typer.echo(render_fleet(cluster.wait_live(cluster.get_directory(), wait)))
    except (DjinnError, ValueError) as exc:
        raise _fail("start", exc) from None


@fleet_app.command()
def join(
    address: str = typer.Argument(..., help="The Ray head, host:port."),
    appliance: bool = APPLIANCE_OPTION,
    num_cpus: int | None = typer.Option(None, help="CPUs this node offers to Ray."),
    num_gpus: int | None = typer.Option(None, help="GPUs this node offers (default: all)."),
) -> None:
    """Join this node to a fleet's Ray cluster; the directory starts its appliance (no
    restart of anything else)."""
    from djinn.fleet import cluster

    code = cluster.ray_start(
        head=False, address=address, appliance=appliance, num_cpus=num_cpus, num_gpus=num_gpus
    )
    raise typer.Exit(code)


@fleet_app.command()
def stop(
    address: str = typer.Option("auto", help="The Ray cluster (host:port, or auto)."),
) -> None:
    """Stop every appliance of the fleet (they drain) and its directory. Ray keeps
    running: `ray stop` on each node ends it."""
    from djinn.errors import DjinnError

    try:
        from djinn.fleet import cluster

        cluster.connect_ray(address)
        cluster.stop_directory(cluster.get_directory())
    except DjinnError as exc:
        raise _fail("stop", exc) from None
    typer.echo("djinn fleet: stopped")
