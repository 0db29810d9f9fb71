"""The open files limit at ``serve``: the soft limit raised to the hard one (as servers do;
systemd starts services at 1,024), and max_connections fitted below it unless given."""

from __future__ import annotations

import re
from pathlib import Path

from node.runtime import FILES_MARGIN, fit_connections
from node.settings import Settings, load
from tests.harness.node import DEFAULT_SETTINGS, NodeProcess

SOFT, HARD = 1024, 2048


def _open_files_limit(pid: int) -> tuple[int, int]:
    limits = Path(f"/proc/{pid}/limits").read_text()
    found = re.search(r"^Max open files\s+(\d+)\s+(\d+)", limits, re.MULTILINE)
    assert found is not None, limits
    return int(found[1]), int(found[2])


def test_serve_raises_the_soft_limit_to_the_hard_one(tmp_path: Path) -> None:
    node = NodeProcess(tmp_path / "data", env=DEFAULT_SETTINGS, open_files=(SOFT, HARD))
    node.start()
    try:
        assert node.proc is not None
        assert _open_files_limit(node.proc.pid) == (HARD, HARD)
        config = node.get_json("/api/v1/config/server_config")
        assert config["max_connections"] == Settings.model_fields["max_connections"].default
    finally:
        node.kill()
        NodeProcess.started.remove(node)


def test_max_connections_leaves_the_node_its_files(tmp_path: Path) -> None:
    default = load(data_dir=tmp_path)
    room = 512 - default.open_file_limit - FILES_MARGIN
    assert fit_connections(default, 4096) is default  # room enough: unchanged
    fitted = fit_connections(default, 512)
    assert fitted.max_connections == room
    assert "max_connections" not in fitted.model_fields_set
    explicit = load(data_dir=tmp_path, max_connections=600)
    assert fit_connections(explicit, 512).max_connections == 600  # kept, with a warning
