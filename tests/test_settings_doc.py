"""docs/configuration.md is generated from ``Settings``: every setting is in it with its
variable, default and unit, and a stale file fails here with the command that fixes it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from node import settings_doc
from node.settings import Settings
from tests.harness.hostdisk import REPO

STALE = f"docs/configuration.md is stale: run `{settings_doc.COMMAND}` and commit the result"


def test_the_committed_configuration_reference_is_current() -> None:
    assert settings_doc.OUT.read_text() == settings_doc.render(), STALE


def test_every_setting_is_documented_with_its_variable_and_a_description() -> None:
    text = settings_doc.render()
    documented = {row.name: row for rows in settings_doc.rows().values() for row in rows}
    assert set(documented) == set(Settings.model_fields)
    for name, row in documented.items():
        assert f"| `{name}` | `NODE_{name.upper()}` |" in text
        assert row.description, name


def test_units_and_defaults_are_rendered_for_people() -> None:
    rows = {row.name: row for rows in settings_doc.rows().values() for row in rows}
    assert (rows["max_entry_size"].default, rows["max_entry_size"].unit) == ("5 MiB", "bytes")
    assert rows["flush_interval_ms"].unit == "milliseconds"
    assert rows["keepalive_timeout_s"].unit == "seconds"
    assert rows["wal_kind"].unit == "one of `journal`, `blockdev`"
    assert rows["data_dir"].default == "`./data`"


def test_check_fails_on_a_stale_file_and_names_the_command(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stale = tmp_path / "configuration.md"
    stale.write_text(settings_doc.render().replace("NODE_HTTP_PORT", "NODE_HTTP_PROT"))
    monkeypatch.setattr(settings_doc, "OUT", stale)
    assert settings_doc.main(["--check"]) == 1
    assert settings_doc.COMMAND in capsys.readouterr().err
    assert settings_doc.main([]) == 0  # regenerates it
    assert settings_doc.main(["--check"]) == 0


def test_the_module_runs_as_documented() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "node.settings_doc", "--check"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, (result.stderr, STALE)
