"""A fleet of appliances on Ray (``djinn fleet``).

A section of the settings table (``djinn.settings``)."""

from __future__ import annotations

from djinn import config_rules as rules

from .setting import Setting

SETTINGS: tuple[Setting, ...] = (
    Setting(
        "fleet_placement",
        "semantic",
        "Which appliance of a fleet gets a session: a plugin of the djinn.placement group "
        "(built in: semantic, where the model the session registers is resident, else "
        "where it fits best; round_robin, in turn). Read by djinn fleet start.",
        check=rules.check_placement,
        shape="semantic, round_robin or another installed policy",
    ),
    Setting(
        "fleet_report_interval",
        0.5,
        "Seconds between the fleet directory's polls of each appliance (free memory, load, "
        "resident models, liveness) and between a fleet client's checks for dead appliances.",
        "float",
        low=0.05,
        high=60.0,
    ),
    Setting(
        "fleet_appliance_host",
        "",
        "Address each fleet appliance binds its TCP listener to and gives clients. Empty: "
        "the node's address as Ray knows it (reachable from the other nodes: keep the "
        "token secret). Read by djinn fleet start.",
    ),
)
