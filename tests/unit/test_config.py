"""The settings table: precedence, sizes, typed errors, generated reference."""

from __future__ import annotations

import pytest

from djinn import config
from djinn.errors import ConfigError


def test_defaults_then_file_then_environment(tmp_path):
    f = tmp_path / "djinn.toml"
    f.write_text('arena_bytes = "2GiB"\ncpu_workers = 3\nheartbeat_interval = 2.5\n')
    cfg = config.load(f, env={"DJINN_CPU_WORKERS": "4"})
    assert cfg.arena_bytes == 2 << 30
    assert cfg.cpu_workers == 4
    assert cfg.heartbeat_interval == 2.5
    assert cfg.tcp_host == "127.0.0.1"
    assert cfg.with_overrides(cpu_workers=7).cpu_workers == 7


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("512MiB", 512 << 20),
        ("1GiB", 1 << 30),
        ("64KiB", 64 << 10),
        ("1048576", 1 << 20),
        ("2G", 2 << 30),
        (4096, 4096),
    ],
)
def test_sizes_parse(text, value):
    assert config.parse_bytes(text) == value


@pytest.mark.parametrize("bad", ["lots", "-1", "1XB", -5])
def test_bad_sizes_are_config_errors(bad):
    with pytest.raises(ConfigError):
        config.parse_bytes(bad)


def test_unknown_key_and_bad_type_are_config_errors(tmp_path):
    f = tmp_path / "djinn.toml"
    f.write_text("no_such_setting = 1\n")
    with pytest.raises(ConfigError, match="no_such_setting"):
        config.load(f, env={})
    f.write_text('cpu_workers = "many"\n')
    with pytest.raises(ConfigError, match="cpu_workers"):
        config.load(f, env={})
    with pytest.raises(ConfigError):
        config.load(tmp_path / "missing.toml", env={})


def test_socket_path_expands_uid():
    import os

    assert str(os.getuid()) in config.load(env={}).socket_path


def test_repository_djinn_toml_documents_every_setting_and_loads():
    from pathlib import Path

    repo_toml = Path(__file__).resolve().parents[2] / "djinn.toml"
    cfg = config.load(repo_toml, env={})
    text = repo_toml.read_text()
    for s in config.SETTINGS:
        assert s.key in text, f"djinn.toml does not document {s.key}"
    assert cfg.tcp_host == "127.0.0.1"


def test_markdown_reference_lists_every_setting():
    table = config.markdown_table()
    for s in config.SETTINGS:
        assert f"`{s.key}`" in table and s.env in table


def test_operations_doc_holds_the_generated_settings_table():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    body = doc.split("<!-- settings:begin -->\n", 1)[1].split("\n<!-- settings:end -->", 1)[0]
    assert body == config.markdown_table(), "regenerate with: python -m djinn.config"
