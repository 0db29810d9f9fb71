"""Offload tests run against both stores: the local directory and moto's S3 server over
HTTP on loopback (tests/harness/moto.py: started once per session; each test gets its own
bucket)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from node.settings import Settings
from tests.harness.moto import new_bucket, s3_settings
from tests.harness.settings import make_settings

# Small blocks and a small stride, so that a ledger of a few hundred KiB spans several
# blocks and many index points.
SMALL_LAYOUT = {
    "managed_ledger_offload_max_block_size_in_bytes": 256 * 1024,
    "managed_ledger_offload_read_buffer_size_in_bytes": 32 * 1024,
}


@pytest.fixture(params=["local", "s3"])
def store_settings(request: pytest.FixtureRequest) -> dict[str, Any]:
    """Settings of the store under test (each test runs against both)."""
    if request.param == "local":
        return {"offload_store": "local"}
    endpoint = request.getfixturevalue("moto_endpoint")
    return s3_settings(endpoint, new_bucket(endpoint))


def offload_settings(data_dir: Path, store: dict[str, Any], **more: Any) -> Settings:
    return make_settings(data_dir, **SMALL_LAYOUT, **store, **more)
