"""A single host needs no Ray: the appliance, the client and the CLI never import it
(issue 13 §4). Only djinn.fleet's own modules do, and only when a fleet is used."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

APPLIANCE_MODULES = [
    "djinn.appliance.supervisor",
    "djinn.appliance.worker",
    "djinn.appliance.handlers",
    "djinn.appliance.model_handlers",
    "djinn.appliance.stats",
]
CLIENT_MODULES = ["djinn", "djinn.runtime.client", "djinn.cli.main", "djinn.fleet"]


def _loads_ray(modules: list[str]) -> list[str]:
    code = (
        "import importlib, json, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted(n for n in sys.modules if n.split('.')[0] == 'ray')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "modules", [APPLIANCE_MODULES, CLIENT_MODULES], ids=["appliance", "client"]
)
def test_importing_djinn_does_not_import_ray(modules):
    assert _loads_ray(modules) == []


def test_a_fleet_address_is_checked_without_ray():
    code = (
        "import sys\n"
        "from djinn import config\n"
        "config.load(env={'DJINN_ADDRESS': 'fleet://head:6379'})\n"
        "print('ray' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
