"""The settings table: precedence, sizes, typed errors, generated reference."""

from __future__ import annotations

import pytest

from djinn import config
from djinn.errors import ConfigError


@pytest.fixture(autouse=True)
def _no_local_config(tmp_path, monkeypatch):
    """load() with no path reads ./djinn.toml and $DJINN_CONFIG: these tests must not
    depend on the directory they run in (the repository's djinn.toml is tested apart)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DJINN_CONFIG", raising=False)


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


# One bad value (or more) per setting, as an operator could type it in djinn.toml; the
# last test below fails when a setting is added without a row here.
BAD_VALUES = {
    "address": ["http://host:1", "tcp://host", "tcp://host:99999", "fleet://head", "ray://"],
    "socket_path": ["/tmp/" + "s" * 120 + ".sock", ["a"]],
    "tcp_enabled": ["maybe", 2],
    "tcp_host": ["", ["127.0.0.1"]],
    "tcp_port": [99999, -1, "http", 80.5, True],
    "token": [["a", "b"]],
    "token_file": [["f"]],
    "gpus": ["abc", "0,0", "-1", ["0"]],
    "cpu_workers": [0, -2, 1000, "many"],
    "follow_ahead": ["sometimes", 1, True],
    "replay_ahead": ["often", 2, False],
    "arena_bytes": ["lots", "1KiB", 0, -5],
    "arena_session_max": [0, 1.5, "half"],
    "arena_reserve": [-0.1, 1.0],
    "inline_max_bytes": ["1GiB", "big"],
    "cpu_worker_memory": ["1MiB", "plenty"],
    "gpu_worker_memory": ["1MiB", "most of it"],
    "vmu_text_fraction": [-0.1, 1.5, "nan"],
    "vmu_data_fraction": [2, "inf"],
    "memory_policy": ["fifo", "", ["lru"]],
    "admission_timeout": [-1, 601, "soon"],
    "session_device_max": ["lots", -1],
    "session_host_max": ["some", -5],
    "kv_recompute": ["sometimes", "", ["auto"]],
    "tenant_device_max": ["lots", -1],
    "tenant_host_max": ["some", -5],
    "scheduler": ["lru", "", ["fifo"]],
    "scheduler_slice_ms": [0, -1, "short"],
    "scheduler_small_graph": [0, 2.5],
    "scheduler_max_wait_ms": [0, "never"],
    "scheduler_weights": ["bob=2", "uid:1000=0", "uid:1000=lots", "host:a"],
    "batch_max": [0, 257, "eight"],
    "tenant_tokens_file": [["a"]],
    "batch_wait_us": [-1, 1_000_001, 0.5],
    "model_roots": [["/a"]],
    "model_allowlist": [["transformers."]],
    "model_methods": ["__reduce__", "_private", "not a name"],
    "heartbeat_interval": [-1, 0, "fast"],
    "heartbeat_misses": [0, 2.5],
    "drain_timeout": [-1],
    "restart_backoff_max": [0, -3],
    "restart_backoff_reset": [-1],
    "embedded_start_timeout": [0],
    "graph_chunk_ops": [-1, 100_001, 2.5, "many"],
    "graph_plan_after": [-1, 1_000_001, 0.5, "often"],
    "graph_compile_after": [-1, 1_000_001, 0.5, "soon"],
    "cuda_graphs": ["yes please", 2],
    "cuda_graph_bytes": ["most", -1],
    "client_spin_us": [-1, 100_001, "fast"],
    "fallback": ["remote", "", ["local"]],
    "fleet_placement": ["nearest", ""],
    "fleet_report_interval": [0, 61, "often"],
    "fleet_appliance_host": [["127.0.0.1"]],
    "recovery_retries": [-1, 101, "three"],
    "recovery_backoff": [-0.1, "soon"],
    "recovery_backoff_max": [-1, 301],
    "recovery_errors": ["SESSION_ENDED", "WORKER_LOST,OOPS"],
    "recovery_checkpoint_bytes": ["1KiB", "lots"],
    "recovery_checkpoint_seconds": [0, "a while"],
    "recovery_standby": ["maybe", 2],
    "recovery_kv": ["both", 1],
    "cpu_threads": [-1, "all"],
    "cpu_threads_beside_client": ["sometimes", 2],
    "cpu_wait_policy": ["spin", "PASSIVE!", 1],
    "worker_spin_us": [-0.5, 1e6, "busy"],
    "client_gc_threshold": [-1, "many"],
    "prewarm": ["maybe", 2],
    "stats_window": [0, 100000],
    "metrics_port": [70000, -1],
    "metrics_host": [""],
    "log_level": ["verbose", 3],
}


def _toml(key: str, value) -> str:
    import json

    return f"{key} = {json.dumps(value)}\n"  # JSON scalars and arrays are TOML too


@pytest.mark.parametrize(
    ("key", "value"), [(k, v) for k, values in BAD_VALUES.items() for v in values]
)
def test_a_bad_value_in_the_file_is_one_line_naming_setting_and_file(tmp_path, key, value):
    f = tmp_path / "djinn.toml"
    f.write_text(_toml(key, value))
    with pytest.raises(ConfigError) as info:
        config.load(f, env={})
    text = str(info.value)
    assert "\n" not in text
    assert text.startswith(f"[CONFIG_ERROR] {key} = ") and str(f) in text


@pytest.mark.parametrize(
    "key", sorted(k for k, vs in BAD_VALUES.items() if any(not isinstance(v, list) for v in vs))
)
def test_a_bad_value_in_the_environment_or_a_flag_names_where_it_came_from(key):
    value = next(v for v in BAD_VALUES[key] if not isinstance(v, list))
    env_value = str(value).lower() if isinstance(value, bool) else str(value)
    setting = {s.key: s for s in config.SETTINGS}[key]
    with pytest.raises(ConfigError, match=setting.env):
        config.load(env={setting.env: env_value})
    with pytest.raises(ConfigError, match=setting.flag):
        config.load(env={}).with_overrides(**{key: env_value})


def test_every_setting_has_a_bad_value_in_the_table():
    assert sorted(BAD_VALUES) == sorted(s.key for s in config.SETTINGS)


def test_vmu_fractions_that_leave_no_stack_fail_at_load(tmp_path):
    f = tmp_path / "djinn.toml"
    f.write_text("vmu_text_fraction = 0.6\nvmu_data_fraction = 0.5\n")
    with pytest.raises(ConfigError, match="less than 1"):
        config.load(f, env={})
    with pytest.raises(ConfigError, match="less than 1"):
        config.load(env={}).with_overrides(vmu_text_fraction=0.7, vmu_data_fraction=0.4)


def test_edge_values_in_range_load(tmp_path):
    f = tmp_path / "djinn.toml"
    f.write_text(
        'tcp_port = 65535\nmetrics_port = 0\ngpus = "0,1"\nlog_level = "DEBUG"\n'
        'arena_bytes = "1MiB"\nheartbeat_misses = 1\ncpu_worker_memory = "auto"\n'
        'address = "tcp://example.org:7711"\nmodel_methods = "generate, score"\n'
    )
    cfg = config.load(f, env={})
    assert (cfg.tcp_port, cfg.gpus, cfg.log_level) == (65535, "0,1", "debug")
    assert cfg.arena_bytes == 1 << 20


def test_an_unknown_setting_suggests_the_nearest_one(tmp_path):
    f = tmp_path / "djinn.toml"
    f.write_text("tcp_prot = 1\n")
    with pytest.raises(ConfigError, match="did you mean tcp_port"):
        config.load(f, env={})


def test_set_assignments_parse_and_name_unknown_keys():
    assert config.parse_assignment("tcp-port=8000") == ("tcp_port", "8000")
    with pytest.raises(ConfigError, match="key=value"):
        config.parse_assignment("tcp_port")
    with pytest.raises(ConfigError, match="nope"):
        config.parse_assignment("nope=1")
