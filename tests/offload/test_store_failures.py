"""An object store that fails: hung (a TCP listener that accepts and never answers), killed
(moto's server stopped), or holding a truncated object. Every failure is a JSON error with a
stable code (502, 503, 504) within the operation timeout, counted by operation; runs go on,
report the ledgers the store held up and set lastError; status still answers."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness.metrics import scrape
from tests.harness.moto import MotoServer, aws_variables, new_bucket, s3_settings
from tests.offload.test_offload import (
    closed_ledger,
    ledger_offload,
    new_client,
    objects,
    offload_of,
    payloads,
    run,
)

TIMEOUT_S = 2.0  # offload_operation_timeout_s here: a hung store fails this fast


@pytest.fixture
def moto(monkeypatch: pytest.MonkeyPatch) -> Iterator[MotoServer]:
    """A moto S3 server of this test's own, which the test may stop and start again."""
    for name in aws_variables():
        monkeypatch.delenv(name)
    server = MotoServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def store(moto: MotoServer) -> dict[str, Any]:
    """Settings of a fresh bucket of ``moto``."""
    return s3_settings(moto.endpoint, new_bucket(moto.endpoint))


@pytest.fixture
def hung_endpoint() -> Iterator[str]:
    """A store that accepts connections and never answers."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


async def metric_samples(client: Any, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {labels: value for (n, labels), value in (await scrape(client)).items() if n == name}


async def offloaded_without_local_copy(
    aiohttp_client: Any, data: Path, store: dict[str, Any], count: int = 60
) -> tuple[int, list[bytes]]:
    client = await new_client(aiohttp_client, data, store, managed_ledger_offload_deletion_lag_ms=0)
    entries = payloads(count, seed=11)
    lid = await closed_ledger(client, entries)
    done = await run(client, {"ledgers": [lid]})
    assert done["offloaded"] == [lid] and done["localDeleted"] == [lid], done
    await client.close()
    return lid, entries


async def test_a_hung_store_is_a_504_within_the_operation_timeout_and_status_still_answers(
    aiohttp_client: Any, tmp_path: Path, store: dict[str, Any], hung_endpoint: str
) -> None:
    data = tmp_path / "data"
    lid, _entries = await offloaded_without_local_copy(aiohttp_client, data, store)

    hung = {**store, "offload_endpoint": hung_endpoint}
    client = await new_client(aiohttp_client, data, hung, offload_operation_timeout_s=TIMEOUT_S)
    started = time.monotonic()
    r = await client.get(f"/api/v1/ledgers/{lid}/entries/0")
    waited = time.monotonic() - started
    assert r.status == 504, await r.text()
    body = await r.json()
    assert body["code"] == "offload_store_timeout"
    assert f"s3://{store['offload_bucket']}/node-0" in body["message"]
    assert "get " in body["message"] and f"{lid}/" in body["message"]
    assert "Debug source" not in body["message"]
    assert TIMEOUT_S - 0.5 < waited < TIMEOUT_S + 3

    started = time.monotonic()
    r = await client.get("/api/v1/offload/status")
    assert r.status == 200, await r.text()
    status = await r.json()
    assert status["unknownObjects"] is None
    assert status["storeError"]["code"] == "offload_store_timeout"
    assert status["totals"]["offloadedLedgers"] == 1
    assert time.monotonic() - started < TIMEOUT_S + 3

    assert offload_of(client).stats.unreadable_objects == 1
    errors = await metric_samples(client, "storage_node_offload_store_errors_total")
    assert errors[(("code", "offload_store_timeout"), ("operation", "get"))] == 1
    assert errors[(("code", "offload_store_timeout"), ("operation", "list"))] == 1
    unreadable = await metric_samples(client, "storage_node_offload_unreadable_objects_total")
    assert unreadable[()] == 1


async def test_a_killed_store_is_a_503_and_a_run_goes_on_and_records_the_error(
    aiohttp_client: Any, tmp_path: Path, moto: MotoServer, store: dict[str, Any]
) -> None:
    data = tmp_path / "data"
    gone, _ = await offloaded_without_local_copy(aiohttp_client, data, store)
    client = await new_client(aiohttp_client, data, store, managed_ledger_offload_deletion_lag_ms=0)
    pending = await closed_ledger(client, payloads(30, seed=12))
    behind = await closed_ledger(client, payloads(30, seed=13))
    await asyncio.to_thread(moto.stop)

    r = await client.get(f"/api/v1/ledgers/{gone}/entries/3")
    assert r.status == 503, await r.text()
    assert (await r.json())["code"] == "offload_store_unavailable"
    assert r.headers["Retry-After"]

    # Deleting an offloaded ledger while the store is down: its objects must wait.
    r = await client.delete(f"/api/v1/ledgers/{gone}")
    assert r.status == 204
    r = await client.post("/api/v1/offload/run", json={})
    assert r.status == 200, await r.text()
    result = await r.json()
    failed = {f["ledgerId"]: f["error"] for f in result["failed"]}
    assert gone in failed and "object store s3://" in failed[gone]
    r = await client.post("/api/v1/offload/run", json={"ledgers": [pending, behind]})
    assert r.status == 200, await r.text()
    result = await r.json()
    assert [f["ledgerId"] for f in result["failed"]] == [gone, pending], result
    # The store is unreachable: the ledgers after the first it failed are not tried.
    assert result["skipped"] == [{"ledgerId": behind, "reason": "store_unreachable"}]
    status = await (await client.get("/api/v1/offload/status")).json()
    assert status["lastError"] and "object store s3://" in status["lastError"]
    assert status["storeError"]["code"] == "offload_store_unavailable"
    r = await client.delete("/api/v1/offload/unknown-objects")
    assert r.status == 503 and (await r.json())["code"] == "offload_store_unavailable"
    assert (await ledger_offload(client, pending))["state"] == "in_progress"

    # The store is back: the next run removes the deleted ledger's objects and offloads.
    await asyncio.to_thread(moto.start)
    result = await run(client, {"ledgers": [pending, behind]})
    assert result["failed"] == [] and result["offloaded"] == [pending, behind], result
    status = await (await client.get("/api/v1/offload/status")).json()
    assert status["lastError"] is None and status["storeError"] is None
    assert status["unknownObjects"] == []
    assert {key.split("/")[0] for key in await objects(client)} == {str(pending), str(behind)}


async def test_a_truncated_data_object_is_a_502_naming_the_object(
    aiohttp_client: Any, tmp_path: Path, store_settings: dict[str, Any]
) -> None:
    data = tmp_path / "data"
    lid, entries = await offloaded_without_local_copy(
        aiohttp_client, data, store_settings, count=200
    )
    client = await new_client(aiohttp_client, data, store_settings)
    attempt = (await ledger_offload(client, lid))["attempt"]
    key = f"{lid}/{attempt}.data"
    store = offload_of(client).store
    whole = await store.get(key)
    await store.put(key, whole[: len(whole) // 2])

    for last in (len(entries) - 1, len(entries) // 2 + 10):  # past the end; across it
        r = await client.get(f"/api/v1/ledgers/{lid}/entries/{last}")
        assert r.status == 502, await r.text()
        body = await r.json()
        assert body["code"] == "offload_object_unreadable"
        assert key in body["message"]
    assert offload_of(client).stats.unreadable_objects == 2
    r = await client.get(f"/api/v1/ledgers/{lid}/entries/0")  # the half that is left
    assert r.status == 200 and await r.read() == entries[0]
