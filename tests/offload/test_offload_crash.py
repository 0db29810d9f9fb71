"""SIGKILL in the middle of an offload (the node as a real process, killed at named steps):
after a restart every entry reads back, the next run finishes the offload, and no object
of the interrupted attempt stays behind."""

from __future__ import annotations

import json
import random
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.harness.moto import new_bucket, s3_settings
from tests.harness.node import NodeProcess

ENTRIES = 200
OCTET = {"Content-Type": "application/octet-stream"}
JSON = {"Content-Type": "application/json"}


def call(node: NodeProcess, method: str, path: str, body: bytes = b"", **headers: str) -> Any:
    req = urllib.request.Request(f"{node.url}{path}", data=body, method=method, headers=headers)
    with urllib.request.urlopen(req, timeout=30) as r:
        raw = r.read()
    return json.loads(raw) if raw else None


def stored_objects(data: Path) -> list[str]:
    root = data / "offload"
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def store_env(store: str, moto_endpoint: str | None) -> dict[str, str]:
    """A node's store settings as its environment (the local store, or a bucket of moto)."""
    if store == "local":
        return {}
    assert moto_endpoint is not None
    settings = s3_settings(moto_endpoint, new_bucket(moto_endpoint))
    return {f"NODE_{name.upper()}": str(value) for name, value in settings.items()}


def incomplete_uploads(node: NodeProcess) -> list[str]:
    status = call(node, "GET", "/api/v1/offload/status")
    assert status["storeError"] is None, status
    return [upload["key"] for upload in status["incompleteUploads"]]


@pytest.mark.parametrize(
    ("point", "store"),
    [
        ("offload.after_attempt_recorded", "local"),
        ("offload.mid_upload", "local"),  # between two parts of the data object
        ("offload.mid_upload", "s3"),
        ("offload.after_upload", "local"),
    ],
)
def test_sigkill_during_an_offload_loses_nothing_and_leaves_no_stray_object(
    tmp_path: Path, point: str, store: str, request: pytest.FixtureRequest
) -> None:
    """A multipart upload the node left (S3: its parts; local: its staging file) is listed
    by status and aborted by the retry."""
    endpoint = request.getfixturevalue("moto_endpoint") if store == "s3" else None
    data = tmp_path / "data"
    rng = random.Random(point)
    entries = [rng.randbytes(rng.randint(1, 8192)) for _ in range(ENTRIES)]
    small = {
        **store_env(store, endpoint),
        "NODE_MANAGED_LEDGER_OFFLOAD_MAX_BLOCK_SIZE_IN_BYTES": str(128 * 1024),
        "NODE_MANAGED_LEDGER_OFFLOAD_READ_BUFFER_SIZE_IN_BYTES": str(16 * 1024),
    }
    node = NodeProcess(data, env={**small, "NODE_CRASH_POINTS": json.dumps([point])})
    try:
        node.start()
        lid = call(node, "POST", "/api/v1/ledgers")["ledgerId"]
        for eid, payload in enumerate(entries):
            call(node, "PUT", f"/api/v1/ledgers/{lid}/entries/{eid}", payload, **OCTET)
        call(node, "POST", f"/api/v1/ledgers/{lid}/close")
        try:
            run = json.dumps({"ledgers": [lid]}).encode()
            call(node, "POST", "/api/v1/offload/run", run, **JSON)
        except urllib.error.HTTPError:
            raise
        except OSError:
            pass  # the node died under the request
        else:
            raise AssertionError("the node answered instead of dying at the crash point")
        node.kill()

        node = NodeProcess(data, env={**small, "NODE_MANAGED_LEDGER_OFFLOAD_DELETION_LAG_MS": "0"})
        node.start()
        state = call(node, "GET", f"/api/v1/ledgers/{lid}")["offload"]
        assert state["state"] == "in_progress" and not state["localDeleted"]
        interrupted = state["attempt"]
        left = [f"{lid}/{interrupted}.data"] if point == "offload.mid_upload" else []
        assert incomplete_uploads(node) == left
        for eid, payload in enumerate(entries):
            assert node.get_bytes(f"/api/v1/ledgers/{lid}/entries/{eid}") == payload

        run = json.dumps({"ledgers": [lid]}).encode()
        done = call(node, "POST", "/api/v1/offload/run", run, **JSON)
        assert done["offloaded"] == [lid] and done["localDeleted"] == [lid], done
        state = call(node, "GET", f"/api/v1/ledgers/{lid}")["offload"]
        assert state["state"] == "offloaded" and state["attempt"] != interrupted
        attempt = state["attempt"]
        if store == "local":
            assert stored_objects(data) == [f"{lid}/{attempt}.data", f"{lid}/{attempt}.index"]
        assert incomplete_uploads(node) == []
        assert call(node, "GET", "/api/v1/offload/status")["unknownObjects"] == []
        for eid, payload in enumerate(entries):
            assert node.get_bytes(f"/api/v1/ledgers/{lid}/entries/{eid}") == payload
        assert node.terminate() == 0
    finally:
        node.kill()
