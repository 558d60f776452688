"""Watching it: metrics, ``djinn top``, logging.

A section of the settings table (``djinn.settings``)."""

from __future__ import annotations

from djinn import config_rules as rules

from .setting import PORT, Setting

SETTINGS: tuple[Setting, ...] = (
    Setting(
        "stats_window",
        60.0,
        "Seconds of recent requests the stats document's latency percentiles cover "
        "(djinn status, djinn top); Prometheus histograms still count since start.",
        "float",
        low=1.0,
        high=3600.0,
    ),
    Setting(
        "metrics_port",
        0,
        "Prometheus endpoint port on metrics_host (0: no endpoint). "
        "Serves request counts and latency histograms, VMU gauges, sessions, restarts.",
        "int",
        **PORT,
    ),
    Setting(
        "metrics_host",
        "127.0.0.1",
        "Bind address of the Prometheus endpoint.",
        check=rules.check_not_empty,
    ),
    Setting(
        "log_level",
        "warning",
        "Logging level for every Djinn component.",
        choices=("debug", "info", "warning", "error", "critical"),
    ),
)
