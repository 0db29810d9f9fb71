"""Offload through the HTTP API, against the local store and moto's S3 server: every entry
reads back byte for byte through the ledger and stream routes, before and after the local
copy goes; deletion lag; deletion of a stream leaves no object; a failed upload deletes
nothing local and the next attempt leaves no stray object; a flipped byte is a 502."""

from __future__ import annotations

import asyncio
import io
import logging
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from node.http.app import build_app
from node.http.state import STORAGE, WORK
from node.offload.format import LedgerIndex, data_key, index_key
from node.offload.service import OffloadService
from node.offload.store import ObjectStore
from node.wire import decode_range, decode_stream_frames, encode_batch
from tests.harness.metrics import scrape
from tests.offload.conftest import offload_settings

BATCH = {"Content-Type": "application/x-entry-batch"}
HOUR_MS = 3600 * 1000


def payloads(count: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(rng.randint(1, 12 * 1024)) for _ in range(count)]


async def new_client(
    aiohttp_client: Any, data_dir: Path, store: dict[str, Any], **more: Any
) -> Any:
    settings = offload_settings(data_dir, store, **more)
    return await aiohttp_client(build_app(settings))


def offload_of(client: TestClient[Any, Any]) -> OffloadService:
    return client.app[WORK].offload  # type: ignore[no-any-return]


async def closed_ledger(client: Any, entries: list[bytes]) -> int:
    r = await client.post("/api/v1/ledgers")
    assert r.status == 201, await r.text()
    lid = (await r.json())["ledgerId"]
    r = await client.post(
        f"/api/v1/ledgers/{lid}/entries", data=io.BytesIO(encode_batch(entries)), headers=BATCH
    )
    assert r.status in (200, 201), await r.text()
    r = await client.post(f"/api/v1/ledgers/{lid}/close")
    assert r.status == 200, await r.text()
    return int(lid)


async def run(client: Any, body: dict[str, Any] | None = None, dry: bool = False) -> dict[str, Any]:
    r = await client.post(f"/api/v1/offload/run?dryRun={str(dry).lower()}", json=body or {})
    assert r.status == 200, await r.text()
    return dict(await r.json())


async def ledger_offload(client: Any, lid: int) -> dict[str, Any]:
    r = await client.get(f"/api/v1/ledgers/{lid}")
    assert r.status == 200, await r.text()
    return dict((await r.json())["offload"])


async def assert_ledger_reads(client: Any, lid: int, entries: list[bytes]) -> None:
    for eid, payload in enumerate(entries):
        r = await client.get(f"/api/v1/ledgers/{lid}/entries/{eid}")
        assert r.status == 200, await r.text()
        assert await r.read() == payload, eid
    r = await client.get(f"/api/v1/ledgers/{lid}/entries?from=0&to={len(entries) - 1}")
    assert r.status == 200
    assert range_entries(await r.read()) == list(enumerate(entries))


def range_entries(body: bytes) -> list[tuple[int, bytes]]:
    """(entry id, payload) of a range read's frames."""
    return list(decode_range(body))


async def objects(client: Any) -> list[str]:
    return sorted(key for key, _size in await offload_of(client).store.list())


async def test_offload_reads_back_every_byte_before_and_after_the_local_copy_goes(
    aiohttp_client: Any, tmp_path: Path, store_settings: dict[str, Any]
) -> None:
    data = tmp_path / "data"
    entries = payloads(300, seed=1)
    client = await new_client(
        aiohttp_client, data, store_settings, managed_ledger_offload_deletion_lag_ms=HOUR_MS
    )
    lid = await closed_ledger(client, entries)
    assert (await ledger_offload(client, lid))["state"] == "none"

    dry = await run(client, {"ledgers": [lid]}, dry=True)
    assert dry["offloaded"] == [lid]
    assert (await ledger_offload(client, lid))["state"] == "none"  # a dry run changes nothing

    done = await run(client, {"ledgers": [lid]})
    assert done["offloaded"] == [lid] and done["failed"] == [] and done["localDeleted"] == []
    state = await ledger_offload(client, lid)
    assert state["state"] == "offloaded" and not state["localDeleted"]
    attempt = state["attempt"]
    assert state["bytes"] > sum(len(p) for p in entries)
    assert await objects(client) == [f"{lid}/{attempt}.data", f"{lid}/{attempt}.index"]

    # Reads go to the object store (tiered storage first), in spans of at most the stride.
    stats = offload_of(client).stats
    await assert_ledger_reads(client, lid, entries)
    assert stats.fetched_bytes >= state["bytes"] - 32 * 1024  # nearly all of it, once
    assert stats.cache_hits > 0 and stats.prefetches > 0

    figures = await metric_values(client)
    assert figures["storage_node_offload_ledgers"] == 1
    assert figures["storage_node_offload_bytes"] == state["bytes"]
    assert figures["storage_node_offload_completed_ledgers_total"] == 1
    assert figures["storage_node_offload_upload_bytes_total"] > state["bytes"]
    assert figures["storage_node_offload_block_cache_hits_total"] == stats.cache_hits
    assert figures["storage_node_offload_block_cache_misses_total"] == stats.cache_misses
    assert figures["storage_node_offload_object_read_seconds_count"] > 0

    again = await run(client, {"ledgers": [lid]})
    assert again["offloaded"] == [] and again["skipped"] == [
        {"ledgerId": lid, "reason": "already_offloaded"}
    ]
    await client.close()

    # The deletion lag passes (a node with a zero lag): the local copy goes, GC reclaims
    # it, and every entry still reads the same, across a restart too.
    client = await new_client(
        aiohttp_client, data, store_settings, managed_ledger_offload_deletion_lag_ms=0
    )
    done = await run(client, {})
    assert done["localDeleted"] == [lid]
    state = await ledger_offload(client, lid)
    assert state == {**state, "state": "offloaded", "attempt": attempt, "localDeleted": True}
    storage = client.app[STORAGE]
    assert storage.index.get_location(lid, 0) is None  # the local copy is garbage now
    await client.app[WORK].gc.run()
    await assert_ledger_reads(client, lid, entries)
    await client.close()
    client = await new_client(aiohttp_client, data, store_settings)
    await assert_ledger_reads(client, lid, entries)

    # Deleting the ledger deletes its objects.
    r = await client.delete(f"/api/v1/ledgers/{lid}")
    assert r.status == 204
    assert await objects(client) == []
    status = await (await client.get("/api/v1/offload/status")).json()
    assert status["unknownObjects"] == [] and status["totals"]["offloadedLedgers"] == 0


async def metric_values(client: Any) -> dict[str, float]:
    """The node's unlabelled samples by name."""
    return {name: value for (name, labels), value in (await scrape(client)).items() if not labels}


async def test_objects_no_ledger_names_are_reported_and_removed_only_on_request(
    aiohttp_client: Any, tmp_path: Path, store_settings: dict[str, Any]
) -> None:
    client = await new_client(aiohttp_client, tmp_path / "data", store_settings)
    lid = await closed_ledger(client, payloads(20, seed=5))
    assert (await run(client, {"ledgers": [lid]}))["offloaded"] == [lid]
    known = await objects(client)
    store = offload_of(client).store
    await store.put("4242/0123abcd.data", b"left by another node")
    await store.put("notes.txt", b"not ours at all")

    status = await (await client.get("/api/v1/offload/status")).json()
    assert sorted(o["key"] for o in status["unknownObjects"]) == ["4242/0123abcd.data", "notes.txt"]
    await run(client, {})
    assert len(await objects(client)) == len(known) + 2  # runs never remove them

    r = await client.delete("/api/v1/offload/unknown-objects")
    assert r.status == 200
    assert sorted((await r.json())["removed"]) == ["4242/0123abcd.data", "notes.txt"]
    assert await objects(client) == known


async def read_stream(client: Any, name: str) -> list[bytes]:
    r = await client.get(f"/api/v1/streams/{name}/entries?limit=10000")
    assert r.status == 200, await r.text()
    return [payload for _, payload in decode_stream_frames(await r.read())]


async def test_stream_policies_offload_closed_ledgers_and_deleting_the_stream_leaves_no_object(
    aiohttp_client: Any, tmp_path: Path, store_settings: dict[str, Any]
) -> None:
    client = await new_client(aiohttp_client, tmp_path / "data", store_settings)
    policies = {
        "maxEntriesPerLedger": 40,
        "minLedgerRolloverTimeMinutes": 0,
        "offloadThresholdInBytes": 0,
        "offloadDeletionLagInMillis": HOUR_MS,
    }
    r = await client.put("/api/v1/streams/orders", json=policies)
    assert r.status == 201, await r.text()
    entries = payloads(130, seed=2)
    for chunk in range(0, len(entries), 10):
        r = await client.post(
            "/api/v1/streams/orders/entries",
            data=encode_batch(entries[chunk : chunk + 10]),
            headers=BATCH,
        )
        assert r.status in (200, 201), await r.text()
    stream = await (await client.get("/api/v1/streams/orders")).json()
    ledger_ids = [info["ledgerId"] for info in stream["ledgers"]]
    closed = ledger_ids[:-1]
    assert len(closed) >= 3

    done = await run(client, {"stream": "orders"})
    assert done["offloaded"] == closed, done
    assert await read_stream(client, "orders") == entries

    # The deletion lag is honoured: an hour has not passed, the local copies stay.
    for lid in closed:
        assert not (await ledger_offload(client, lid))["localDeleted"]
    status = await (await client.get("/api/v1/offload/status")).json()
    assert status["streams"]["orders"]["offloadedLedgers"] == len(closed)
    assert status["streams"]["orders"]["awaitingDeletionBytes"] > 0
    assert status["totals"]["lagSeconds"] == 0

    # With the lag at zero, the next run drops them; reads do not change.
    r = await client.put(
        "/api/v1/streams/orders", json={**policies, "offloadDeletionLagInMillis": 0}
    )
    assert r.status == 200
    done = await run(client, {})
    assert done["offloaded"] == [] and sorted(done["localDeleted"]) == closed
    assert await read_stream(client, "orders") == entries

    assert len(await objects(client)) == 2 * len(closed)
    r = await client.delete("/api/v1/streams/orders")
    assert r.status == 204, await r.text()
    assert await objects(client) == []


def flip_byte_of_entry(data_path: Path, index_path: Path, entry_id: int) -> None:
    """Flip one bit in the middle of the span that holds ``entry_id``."""
    index = LedgerIndex.decode(index_path.read_bytes())
    point = index.points[index.point_of(entry_id)]
    damaged = bytearray(data_path.read_bytes())
    damaged[point.offset + point.length // 2] ^= 0x40
    data_path.write_bytes(bytes(damaged))


class FailingStore(ObjectStore):
    """The real store, whose multipart uploads fail after ``parts`` parts (a store that
    breaks mid-upload)."""

    def __init__(self, inner: ObjectStore, parts: int) -> None:
        vars(self).update(vars(inner))
        self._parts = parts

    async def put_multipart(self, key: str, parts: AsyncIterator[bytes], part_size: int) -> None:
        async def failing() -> AsyncIterator[bytes]:
            sent = 0
            async for part in parts:
                if sent == self._parts:
                    raise ConnectionError("the store went away mid-upload")
                sent += 1
                yield part

        await super().put_multipart(key, failing(), part_size)


async def test_an_upload_failing_part_way_deletes_nothing_and_the_retry_leaves_no_stray_object(
    aiohttp_client: Any, tmp_path: Path, store_settings: dict[str, Any]
) -> None:
    client = await new_client(
        aiohttp_client, tmp_path / "data", store_settings, managed_ledger_offload_deletion_lag_ms=0
    )
    entries = payloads(300, seed=3)
    lid = await closed_ledger(client, entries)
    offloader = offload_of(client).offloader
    real = offloader.store
    offloader.store = FailingStore(real, parts=2)
    done = await run(client, {"ledgers": [lid]})
    assert done["offloaded"] == [] and [f["ledgerId"] for f in done["failed"]] == [lid]
    assert "mid-upload" in done["failed"][0]["error"]
    state = await ledger_offload(client, lid)
    assert state["state"] == "in_progress" and not state["localDeleted"]
    failed_attempt = state["attempt"]
    assert await objects(client) == []
    await assert_ledger_reads(client, lid, entries)  # from the local copy

    offloader.store = real
    done = await run(client, {"ledgers": [lid]})
    assert done["offloaded"] == [lid] and done["localDeleted"] == [lid]
    state = await ledger_offload(client, lid)
    assert state["state"] == "offloaded" and state["attempt"] != failed_attempt
    assert await objects(client) == [
        f"{lid}/{state['attempt']}.data",
        f"{lid}/{state['attempt']}.index",
    ]
    await assert_ledger_reads(client, lid, entries)


async def test_a_flipped_byte_in_a_data_object_is_a_502_naming_the_object(
    aiohttp_client: Any, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    client = await new_client(aiohttp_client, data, {"offload_store": "local"})
    entries = payloads(100, seed=4)
    lid = await closed_ledger(client, entries)
    assert (await run(client, {"ledgers": [lid]}))["offloaded"] == [lid]
    attempt = (await ledger_offload(client, lid))["attempt"]
    path = data / "offload" / data_key(lid, attempt)
    index_path = data / "offload" / index_key(lid, attempt)
    await asyncio.to_thread(flip_byte_of_entry, path, index_path, len(entries) // 2)
    unreadable_before = offload_of(client).stats.unreadable_objects

    r = await client.get(f"/api/v1/ledgers/{lid}/entries/{len(entries) // 2}")
    assert r.status == 502
    body = await r.json()
    assert body["code"] == "offload_object_unreadable"
    assert data_key(lid, attempt) in body["message"]
    assert offload_of(client).stats.unreadable_objects > unreadable_before
    # Entries of undamaged spans still read, and right.
    r = await client.get(f"/api/v1/ledgers/{lid}/entries/0")
    assert r.status == 200 and await r.read() == entries[0]

    await asyncio.to_thread(path.unlink)  # a missing object: the same error
    offload_of(client).reader.forget(lid)
    r = await client.get(f"/api/v1/ledgers/{lid}/entries/0")
    assert r.status == 502 and (await r.json())["code"] == "offload_object_unreadable"


class PausingStore(ObjectStore):
    """The real store, whose multipart uploads stop after their first part until ``go`` is
    set (an upload long enough for something to happen meanwhile)."""

    def __init__(self, inner: ObjectStore) -> None:
        vars(self).update(vars(inner))
        self.paused = asyncio.Event()
        self.go = asyncio.Event()

    async def put_multipart(self, key: str, parts: AsyncIterator[bytes], part_size: int) -> None:
        async def pausing() -> AsyncIterator[bytes]:
            async for part in parts:
                yield part
                if not self.go.is_set():
                    self.paused.set()
                    await self.go.wait()

        await super().put_multipart(key, pausing(), part_size)


async def test_a_ledger_deleted_during_its_offload_is_skipped_not_failed(
    aiohttp_client: Any,
    tmp_path: Path,
    store_settings: dict[str, Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    client = await new_client(aiohttp_client, tmp_path / "data", store_settings)
    lid = await closed_ledger(client, payloads(300, seed=6))
    offloader = offload_of(client).offloader
    offloader.store = pausing = PausingStore(offloader.store)
    running = asyncio.ensure_future(run(client, {"ledgers": [lid]}))
    await asyncio.wait_for(pausing.paused.wait(), 30)
    r = await client.delete(f"/api/v1/ledgers/{lid}")  # as a stream's deletion or retention
    assert r.status == 204
    pausing.go.set()
    done = await running

    assert done["skipped"] == [{"ledgerId": lid, "reason": "deleted"}], done
    assert done["failed"] == [] and done["offloaded"] == []
    status = await (await client.get("/api/v1/offload/status")).json()
    assert status["lastError"] is None and status["unknownObjects"] == []
    assert await objects(client) == []
    assert offload_of(client).stats.upload_failures == 0
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
