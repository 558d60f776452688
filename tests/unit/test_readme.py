"""The README's two set-up commands are the ones CI runs, verbatim."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _setup_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Set up", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", section)


def test_readme_has_exactly_two_setup_commands_installing_cpu_torch_first():
    commands = _setup_commands()
    assert len(commands) == 2
    for cmd in commands:
        assert cmd.startswith("pip install torch==2.13.0 && ")


def test_ci_runs_both_readme_commands_verbatim():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    for cmd in _setup_commands():
        assert cmd in ci


def test_pyproject_torch_range_admits_the_cpu_wheel():
    text = (ROOT / "pyproject.toml").read_text()
    spec = re.search(r'"torch([^"]*)"', text).group(1)
    from packaging.specifiers import SpecifierSet

    assert "2.13.0" in SpecifierSet(spec)
