"""moto's S3 server over HTTP on loopback: the object store of the offload and DAG tests.
Each test makes its own bucket (new_bucket) on a server shared per session (the
``moto_endpoint`` fixture of tests/conftest.py), or starts a MotoServer of its own when it
must stop the store."""

from __future__ import annotations

import os
import uuid
from typing import Any

import boto3
from moto.server import ThreadedMotoServer

from tests.harness.ports import free_port

REGION = "us-east-1"
KEY_ID = "offload-test-key"
SECRET = "offload-test-secret"  # moto accepts any credentials


class MotoServer:
    """A moto S3 server on a free port, which a test may stop and start again on the same port
    (moto keeps its buckets in the process, so they come back with it)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._server: ThreadedMotoServer | None = None

    def start(self) -> None:
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None


def aws_variables() -> list[str]:
    """The AWS_* variables of this process: S3Store reads the environment, so a test clears
    them before it starts a node against moto (nothing stray may leak in)."""
    return [name for name in os.environ if name.startswith("AWS_")]


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


def s3_client(endpoint: str) -> Any:
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name=REGION,
        aws_access_key_id=KEY_ID,
        aws_secret_access_key=SECRET,
    )


def new_bucket(endpoint: str) -> str:
    name = f"offload-{uuid.uuid4().hex[:12]}"
    s3_client(endpoint).create_bucket(Bucket=name)
    return name
