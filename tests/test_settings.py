"""The one settings object: defaults, NODE_* variables, config file, refusals."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from node.settings import Settings, SettingsError, load


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
    assert s.journal_max_group_wait_msec == 2 and s.journal_buffered_writes_threshold == 512 * 1024
    assert s.log_size_limit == 1 << 30 and s.flush_interval == 10_000
    assert s.journal_max_size == 2 << 30 and s.journal_pre_alloc_size == 16 << 20
    assert s.journal_max_backups == 5 and s.db_storage_max_throttle_time_ms == 10_000
    assert (s.minor_compaction_threshold, s.major_compaction_threshold) == (0.2, 0.8)
    assert s.gc_wait_time == 600_000 and s.max_entry_size == 5 << 20
    assert s.journal_dir == Path("./data/journal") and s.index_dir == Path("./data/index")


def test_environment_and_config_file_and_precedence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "node.toml"
    config.write_text('log_size_limit = 16777216\nhttp_port = 9000\ndata_dir = "/from/file"\n')
    monkeypatch.setenv("NODE_HTTP_PORT", "9100")
    monkeypatch.setenv("NODE_GC_WAIT_TIME", "1000")
    s = load(config, data_dir=Path("/from/cli"))
    assert s.log_size_limit == 16 << 20  # file
    assert s.http_port == 9100  # environment beats the file
    assert s.data_dir == Path("/from/cli")  # explicit beats both
    assert s.gc_wait_time == 1000
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
        ({"minor_compaction_interval": 90_000}, "minor_compaction_interval"),
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
        ("NODE_FLUSH_INTERVAL", "10s", "milliseconds"),  # the unit is not in the name
        ("NODE_MAJOR_COMPACTION_INTERVAL", "1d", "seconds"),
        ("NODE_REQUEST_BUDGET_WAIT_S", "1s", "seconds"),  # ... or is, as a suffix
        ("NODE_MAX_LONG_POLL_MS", "1m", "milliseconds"),
    ],
)
def test_a_number_with_a_unit_is_refused_naming_the_unit(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, unit: str
) -> None:
    """``NODE_FLUSH_INTERVAL=10s`` was once refused without naming the unit."""
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
