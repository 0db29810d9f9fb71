"""The node's settings for in-process tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from node.settings import Settings, load
from tests.harness.hostdisk import HOST_DISK_NEUTRAL


def make_settings(data_dir: Path, **overrides: Any) -> Settings:
    """Settings for tests: small enough to exercise rolls and swaps quickly."""
    base: dict[str, Any] = {
        **HOST_DISK_NEUTRAL,
        "data_dir": data_dir,
        "journal_pre_alloc_size": 1 << 20,
        "db_storage_write_cache_max_size": 16 << 20,
        "db_storage_read_ahead_cache_max_size": 4 << 20,
        "max_entry_size": 1 << 20,
        "max_request_size": 8 << 20,
    }
    base.update(overrides)
    return load(**base)
