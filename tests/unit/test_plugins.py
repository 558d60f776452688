"""Plugins come from entry points: third-party ones are found and used, broken ones are
skipped with a warning, and listing imports nothing."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


def _fake_distribution(root: Path, name: str, entry_points: str, module_code: str) -> None:
    """What `pip install` leaves behind: a module and a .dist-info with entry points."""
    (root / f"{name}.py").write_text(textwrap.dedent(module_code))
    info = root / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))


@pytest.fixture
def site(tmp_path: Path) -> Path:
    _fake_distribution(
        tmp_path,
        "acme_djinn_plugin",
        """
        [djinn.patterns]
        acme_speech = acme_djinn_plugin:SpeechPattern
        [djinn.cost_models]
        acme_flat = acme_djinn_plugin:FlatCost
    """,
        """
        from djinn.semantics.protocols import CostEstimate, PatternMatch

        class SpeechPattern:
            name = "acme_speech"
            def match(self, graph, ctx):
                if any("Speech" in n.module for n in graph.nodes):
                    return PatternMatch(self.name, 0.99, "forward", "audio", [0])
                return None

        class FlatCost:
            name = "acme_flat"
            def estimate(self, graph, device):
                return CostEstimate(self.name, 1.0, graph.total_flops, 0, "compute")
    """,
    )
    _fake_distribution(
        tmp_path,
        "broken_djinn_plugin",
        """
        [djinn.patterns]
        broken = broken_djinn_plugin:Nope
        [djinn.schedulers]
        broken_scheduler = broken_djinn_plugin:Nope
    """,
        """
        raise ImportError("this plugin is broken on purpose")
    """,
    )
    return tmp_path


def _run(site: Path, code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *sys.path])}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_third_party_plugin_is_found_and_used_and_a_broken_one_skipped(site):
    out = _run(
        site,
        """
        import torch, warnings
        from djinn.semantics.analyze import analyze
        from djinn.semantics.registry import default_registry

        class SpeechEncoder(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.proj = torch.nn.Linear(80, 32)
            def forward(self, x):
                return self.proj(x).relu()

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            a = analyze(SpeechEncoder(), torch.randn(2, 50, 80))
        print("phase", a.phase, a.modality, a.matches[0].pattern)
        print("broken", sorted(default_registry().broken))
        print("warned", any("broken_djinn_plugin" in str(w.message) for w in caught))
    """,
    )
    assert out.returncode == 0, out.stderr
    assert "phase forward audio acme_speech" in out.stdout
    assert "broken ['djinn.patterns:broken']" in out.stdout
    assert "warned True" in out.stdout


def test_listing_plugins_imports_none_of_them(site):
    out = _run(
        site,
        """
        import sys
        from djinn.semantics.registry import list_plugins
        names = {(p.group, p.name, p.distribution) for p in list_plugins()}
        print(("patterns", "acme_speech", "acme_djinn_plugin") in names,
              ("patterns", "broken", "broken_djinn_plugin") in names,
              ("cost_models", "roofline", "djinn") in names)
        print("imported", [m for m in ("acme_djinn_plugin", "broken_djinn_plugin",
                                       "djinn.plugins.patterns") if m in sys.modules])
    """,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["True True True", "imported []"]


def test_cli_lists_plugins_and_check_reports_the_broken_one(site):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *sys.path])}
    listed = subprocess.run(
        [sys.executable, "-m", "djinn.cli.main", "plugins"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert listed.returncode == 0 and "acme_speech" in listed.stdout
    checked = subprocess.run(
        [sys.executable, "-m", "djinn.cli.main", "plugins", "--check"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert checked.returncode == 1
    assert "BROKEN: ImportError: this plugin is broken on purpose" in checked.stdout
    assert "llm" in checked.stdout and "ok" in checked.stdout
    # every group is imported, not only patterns and cost models
    line = next(x for x in checked.stdout.splitlines() if "broken_scheduler" in x)
    assert "BROKEN" in line


def test_every_builtin_is_registered_through_entry_points():
    from djinn.semantics.registry import list_plugins

    builtins = {p.name for p in list_plugins() if p.distribution == "djinn"}
    assert builtins >= {
        "attention",
        "llm",
        "text_encoder",
        "conv_pipeline",
        "recommendation",
        "fusion",
        "roofline",
        "semantic",
        "lru",
        "fifo",
    }
