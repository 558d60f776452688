"""The operator's commands: a bad setting is one line and exit code 2 from every command,
and every setting is a `djinn serve` flag (issue 16 §2, §6)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest

from djinn import config

EXIT_CONFIG = 2


def _djinn(*args: str, cwd=None, **env: str) -> subprocess.CompletedProcess:
    """Run `djinn`, by default in an empty directory: no ./djinn.toml but the test's own."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DJINN_")}
    if cwd is None:
        # A directory of its own, removed after: every call made one and left it in /tmp.
        with tempfile.TemporaryDirectory(prefix="djinn-cli-") as empty:
            return _djinn(*args, cwd=empty, **env)
    return subprocess.run(
        [sys.executable, "-m", "djinn.cli.main", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**clean, "COLUMNS": "200", **env},
        timeout=120,
    )


def _one_config_error_line(done: subprocess.CompletedProcess, *fragments: str) -> None:
    assert done.returncode == EXIT_CONFIG, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr  # no traceback
    assert "[CONFIG_ERROR]" in lines[0]
    for fragment in fragments:
        assert fragment in lines[0]


@pytest.mark.parametrize("command", ["serve", "status", "top"])
def test_a_missing_config_file_is_one_line_and_exit_2(command):
    done = _djinn(command, "--config", "/nonexistent/djinn.toml")
    _one_config_error_line(done, f"djinn {command}:", "/nonexistent/djinn.toml")


@pytest.mark.parametrize(
    ("line", "fragment"),
    [
        ("tcp_port = 99999", "tcp_port = 99999"),
        ('log_level = "verbose"', "log_level = 'verbose'"),
        ("heartbeat_interval = -1", "heartbeat_interval = -1"),
        ("vmu_text_fraction = 0.7\nvmu_data_fraction = 0.7", "vmu_data_fraction"),
    ],
)
def test_serve_refuses_a_bad_djinn_toml_in_one_line_with_exit_2(tmp_path, line, fragment):
    (tmp_path / "djinn.toml").write_text(line + "\n")
    _one_config_error_line(_djinn("serve", cwd=tmp_path), fragment)


@pytest.mark.parametrize("command", ["serve", "status", "top", "run"])
def test_every_command_refuses_a_bad_local_djinn_toml_in_one_line(tmp_path, command):
    (tmp_path / "djinn.toml").write_text('gpus = "abc"\n')
    (tmp_path / "script.py").write_text("print('the script ran')\n")
    args = [command, "script.py"] if command == "run" else [command]
    done = _djinn(*args, cwd=tmp_path)
    _one_config_error_line(done, f"djinn {command}:", "gpus = 'abc'", str(tmp_path))
    assert "the script ran" not in done.stdout


def test_a_bad_flag_or_assignment_is_one_line_naming_the_flag():
    _one_config_error_line(_djinn("serve", "--tcp-port", "99999"), "--tcp-port")
    _one_config_error_line(_djinn("serve", "--set", "log_level=verbose"), "--set log_level")
    _one_config_error_line(_djinn("serve", "--set", "tcp_prot=1"), "did you mean tcp_port")


def test_a_bad_environment_variable_is_one_line_naming_it():
    done = _djinn("serve", DJINN_HEARTBEAT_MISSES="0")
    _one_config_error_line(done, "DJINN_HEARTBEAT_MISSES")


def test_serve_help_lists_every_setting_as_a_flag_with_its_help():
    done = _djinn("serve", "--help")
    assert done.returncode == 0
    text = " ".join(done.stdout.split())  # help wraps long lines
    for s in config.SETTINGS:
        assert s.flag in text, s.key
        assert s.env in text, s.key
    assert "--set" in text and "--no-tcp" in text


def test_serve_flags_and_set_assignments_reach_the_appliance(tmp_path):
    """--set beats the file and a flag beats --set: the session and the stats show it."""
    from tests.conftest import start_appliance

    args = ["--set", "heartbeat_interval=0.25", "--set", "stats_window=3", "--stats-window", "7"]
    app = start_appliance(tmp_path, heartbeat_interval=1.0, stats_window=30.0, serve_args=args)
    try:
        with app.connect() as client, client.session() as s:
            assert s.heartbeat_interval == 0.25
        assert app.stats()["appliance"]["stats_window_s"] == 7.0
    finally:
        app.stop()


@pytest.mark.parametrize("command", ["status", "top"])
@pytest.mark.parametrize("address", ["foo", "tcp://127.0.0.1:99999", "tcp://host"])
def test_a_bad_address_flag_is_one_line_and_exit_2(command, address):
    done = _djinn(command, "--address", address)
    _one_config_error_line(done, f"djinn {command}:", repr(address))
