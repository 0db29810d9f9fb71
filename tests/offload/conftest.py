"""Offload tests run against both stores: the local directory and moto's S3 server over
HTTP on loopback (started once per session; each test gets its own bucket)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from moto.server import ThreadedMotoServer

from node.settings import Settings
from tests.conftest import make_settings
from tests.crash.nodeproc import free_port

REGION = "us-east-1"
KEY_ID = "offload-test-key"
SECRET = "offload-test-secret"  # moto accepts any credentials
# Small blocks and a small stride, so that a ledger of a few hundred KiB spans several
# blocks and many index points.
SMALL_LAYOUT = {
    "managed_ledger_offload_max_block_size_in_bytes": 256 * 1024,
    "managed_ledger_offload_read_buffer_size_in_bytes": 32 * 1024,
}


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        del os.environ[name]  # S3Store reads the environment: nothing stray may leak in
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


def s3_settings(endpoint: str, bucket: str) -> dict[str, Any]:
    return {
        "offload_store": "s3",
        "offload_bucket": bucket,
        "offload_prefix": "node-0",
        "offload_endpoint": endpoint,
        "offload_region": REGION,
        "offload_access_key_id": KEY_ID,
        "offload_secret_access_key": SECRET,
    }


def new_bucket(endpoint: str) -> str:
    name = f"offload-{uuid.uuid4().hex[:12]}"
    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name=REGION,
        aws_access_key_id=KEY_ID,
        aws_secret_access_key=SECRET,
    )
    client.create_bucket(Bucket=name)
    return name


@pytest.fixture(params=["local", "s3"])
def store_settings(request: pytest.FixtureRequest) -> dict[str, Any]:
    """Settings of the store under test (each test runs against both)."""
    if request.param == "local":
        return {"offload_store": "local"}
    endpoint = request.getfixturevalue("moto_endpoint")
    return s3_settings(endpoint, new_bucket(endpoint))


def offload_settings(data_dir: Path, store: dict[str, Any], **more: Any) -> Settings:
    return make_settings(data_dir, **SMALL_LAYOUT, **store, **more)
