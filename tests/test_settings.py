"""The one settings object: defaults, NODE_* variables, config file, refusals."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from node.settings import RENAMED, Settings, SettingsError, load


def test_defaults_are_spec_md(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(__import__("os").environ):
        if name.startswith("NODE_"):
            monkeypatch.delenv(name)
    s = load()
    assert (s.data_dir, s.http_host, s.http_port, s.wal_kind) == (
        Path("./data"),
        "127.0.0.1",
        8080,
        "journal",
    )
    assert s.journal_max_group_wait_ms == 2 and s.journal_buffered_writes_threshold == 512 * 1024
    assert s.log_size_limit == 1 << 30 and s.flush_interval_ms == 10_000
    assert s.journal_max_size == 2 << 30 and s.journal_pre_alloc_size == 16 << 20
    assert s.journal_max_backups == 5 and s.db_storage_max_throttle_time_ms == 10_000
    assert (s.minor_compaction_threshold, s.major_compaction_threshold) == (0.2, 0.8)
    assert s.gc_wait_time_ms == 600_000 and s.max_entry_size == 5 << 20
    assert s.journal_dir == Path("./data/journal") and s.index_dir == Path("./data/index")


def test_environment_and_config_file_and_precedence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "node.toml"
    config.write_text('log_size_limit = 16777216\nhttp_port = 9000\ndata_dir = "/from/file"\n')
    monkeypatch.setenv("NODE_HTTP_PORT", "9100")
    monkeypatch.setenv("NODE_GC_WAIT_TIME_MS", "1000")
    s = load(config, data_dir=Path("/from/cli"))
    assert s.log_size_limit == 16 << 20  # file
    assert s.http_port == 9100  # environment beats the file
    assert s.data_dir == Path("/from/cli")  # explicit beats both
    assert s.gc_wait_time_ms == 1000
    as_json = tmp_path / "node.json"
    as_json.write_text(json.dumps({"journal_max_backups": 2}))
    assert load(as_json).journal_max_backups == 2
    assert isinstance(load(as_json), Settings)


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"minor_compaction_threshold": 0.9}, "minor_compaction_threshold"),
        ({"major_compaction_threshold": 1.5}, "major_compaction_threshold"),
        ({"log_size_limit": -1}, "log_size_limit"),
        ({"minor_compaction_interval_s": 90_000}, "minor_compaction_interval_s"),
        ({"http_port": 70000}, "http_port"),
        ({"no_such_setting": 1}, "no_such_setting"),
        ({"wal_kind": "blockdev"}, "wal_path"),
        ({"wal_kind": "journal", "wal_path": "/dev/nvme1n1"}, "wal_path"),
    ],
)
def test_invalid_settings_are_refused_naming_the_setting(
    values: dict[str, object], named: str
) -> None:
    with pytest.raises(SettingsError, match=named):
        load(**values)


def test_bad_environment_value_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NODE_JOURNAL_MAX_SIZE", "lots")
    with pytest.raises(SettingsError, match="NODE_JOURNAL_MAX_SIZE"):
        load()


@pytest.mark.parametrize(
    ("variable", "value", "unit"),
    [
        ("NODE_FLUSH_INTERVAL_MS", "10s", "milliseconds"),
        ("NODE_MAJOR_COMPACTION_INTERVAL_S", "1d", "seconds"),
        ("NODE_REQUEST_BUDGET_WAIT_S", "1s", "seconds"),
        ("NODE_MAX_LONG_POLL_MS", "1m", "milliseconds"),
        ("NODE_FLUSH_INTERVAL", "10s", "milliseconds"),  # an old name: its new one's unit
    ],
)
def test_a_number_with_a_unit_is_refused_naming_the_unit(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, unit: str
) -> None:
    """``NODE_FLUSH_INTERVAL_MS=10s`` was once refused without naming the unit."""
    monkeypatch.setenv(variable, value)
    with pytest.raises(SettingsError) as refused:
        load()
    message = str(refused.value)
    assert variable in message and repr(value) in message
    assert f"the unit is {unit}" in message and "no unit suffix" in message


def test_misspelled_environment_variable_is_refused_naming_the_closest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("NODE_HTTP_PROT", "9000")
    with pytest.raises(SettingsError, match=r"NODE_HTTP_PROT; did you mean NODE_HTTP_PORT\?"):
        load()


def test_unknown_config_file_key_is_refused_naming_the_closest(tmp_path: Path) -> None:
    config = tmp_path / "node.toml"
    config.write_text("journal_max_backup = 3\n")
    with pytest.raises(SettingsError, match=r"'journal_max_backup'.*mean journal_max_backups"):
        load(config)


def test_node_js_variables_are_not_taken_for_typos(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NODE_OPTIONS", "--max-old-space-size=4096")
    monkeypatch.setenv("NODE_EXTRA_CA_CERTS", "/etc/ssl/certs/ca-certificates.crt")
    assert isinstance(load(), Settings)


def test_serve_refuses_to_start_with_a_clear_message(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("minor_compaction_threshold = 0.95\n")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "node",
            "serve",
            "--config",
            str(config),
            "--data-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "refusing to start" in result.stderr and "minor_compaction_threshold" in result.stderr


def _clear_node_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.upper().startswith("NODE_"):
            monkeypatch.delenv(name)


@pytest.mark.parametrize(("old", "new"), sorted(RENAMED.items()))
def test_an_old_variable_sets_the_new_setting_and_says_so(
    monkeypatch: pytest.MonkeyPatch, old: str, new: str
) -> None:
    """Durations got their unit in their name: a NODE_* variable set for the old name (a
    BookKeeper or RocketMQ habit) still sets the same value, with a warning naming both."""
    _clear_node_env(monkeypatch)
    value = Settings.model_fields[new].default + 1  # valid for each, and not the default
    monkeypatch.setenv(f"NODE_{old.upper()}", str(value))
    s = load()
    assert getattr(s, new) == value and new in s.model_fields_set
    assert s.deprecations == (
        f"NODE_{old.upper()} is deprecated: it is now NODE_{new.upper()} (the same value, "
        "in the same unit); rename it",
    )


def test_an_old_name_in_the_config_file_sets_the_new_setting_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _clear_node_env(monkeypatch)
    config = tmp_path / "node.toml"
    config.write_text("destroy_maped_file_interval_forcibly = 5000\n")
    s = load(config)
    assert s.destroy_mapped_file_interval_forcibly_ms == 5000
    assert len(s.deprecations) == 1
    assert "destroy_maped_file_interval_forcibly in config file" in s.deprecations[0]
    assert "now destroy_mapped_file_interval_forcibly_ms" in s.deprecations[0]
    # The environment's new name beats the file's old one, as any variable beats the file.
    monkeypatch.setenv("NODE_DESTROY_MAPPED_FILE_INTERVAL_FORCIBLY_MS", "7000")
    assert load(config).destroy_mapped_file_interval_forcibly_ms == 7000


def test_new_names_warn_of_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    _clear_node_env(monkeypatch)
    monkeypatch.setenv("NODE_FLUSH_INTERVAL_MS", "5000")
    assert load().deprecations == ()


def test_an_old_and_a_new_name_of_one_setting_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _clear_node_env(monkeypatch)
    monkeypatch.setenv("NODE_GC_WAIT_TIME", "1000")
    monkeypatch.setenv("NODE_GC_WAIT_TIME_MS", "2000")
    with pytest.raises(
        SettingsError, match="NODE_GC_WAIT_TIME and NODE_GC_WAIT_TIME_MS are both set"
    ):
        load()
    _clear_node_env(monkeypatch)
    config = tmp_path / "node.toml"
    config.write_text("flush_interval = 1000\nflush_interval_ms = 2000\n")
    with pytest.raises(SettingsError, match="flush_interval and flush_interval_ms are both set"):
        load(config)


def test_an_old_name_in_code_is_refused() -> None:
    """Only what operators write keeps the old names; the code says the new ones."""
    with pytest.raises(SettingsError, match="did you mean flush_interval_ms"):
        load(flush_interval=1000)


def test_serve_logs_each_old_name_once_at_start(tmp_path: Path) -> None:
    """The warning is logged once logging is set up (here: before the start is refused for
    a port in use, the first refusal after it)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.upper().startswith("NODE_")}
        env |= {"NODE_FLUSH_INTERVAL": "5000", "NODE_HTTP_PORT": str(port)}
        result = subprocess.run(
            [sys.executable, "-m", "node", "serve", "--data-dir", str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
    assert result.returncode != 0 and "port" in result.stderr
    warning = "NODE_FLUSH_INTERVAL is deprecated: it is now NODE_FLUSH_INTERVAL_MS"
    assert result.stderr.count(warning) == 1, result.stderr
