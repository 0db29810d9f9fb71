"""/metrics parses with prometheus-client's parser and moves by the right amounts."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from node.http.app import build_app
from node.http.state import STORAGE
from node.settings import KiB, MiB, Settings
from node.storage.ringformat import HEADER_AREA
from node.wire import encode_batch
from tests.harness.loopdev import loop_device
from tests.harness.metrics import scrape
from tests.harness.settings import make_settings

OCTET = {"Content-Type": "application/octet-stream"}
BATCH = {"Content-Type": "application/x-entry-batch"}


def _value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_metrics_move_by_the_right_amounts(client: Any) -> None:
    before = await scrape(client)
    lid = (await (await client.post("/api/v1/ledgers")).json())["ledgerId"]
    for i in range(7):
        r = await client.post(f"/api/v1/ledgers/{lid}/entries", data=bytes(100 + i), headers=OCTET)
        assert r.status == 201
    r = await client.post(
        f"/api/v1/ledgers/{lid}/entries", data=encode_batch([b"a" * 10] * 5), headers=BATCH
    )
    assert r.status == 201
    for i in range(3):
        assert (await client.get(f"/api/v1/ledgers/{lid}/entries/{i}")).status == 200
    assert (await client.get(f"/api/v1/ledgers/{lid}/entries/99")).status == 404
    after = await scrape(client)

    def delta(name: str, **labels: str) -> float:
        return _value(after, name, **labels) - _value(before, name, **labels)

    assert delta("storage_node_adds_total") == 12
    assert delta("storage_node_add_payload_bytes_total") == sum(100 + i for i in range(7)) + 50
    assert delta("storage_node_reads_total") == 3
    assert delta("storage_node_add_latency_seconds_count", kind="single") == 7
    assert delta("storage_node_add_latency_seconds_count", kind="batch") == 1
    assert delta("storage_node_read_latency_seconds_count", kind="entry") == 4
    route = "/api/v1/ledgers/{lid}/entries"
    assert (
        delta(
            "storage_node_http_request_duration_seconds_count",
            method="POST",
            route=route,
            status="201",
        )
        == 8
    )
    assert (
        delta(
            "storage_node_http_request_duration_seconds_count",
            method="GET",
            route="/api/v1/ledgers/{lid}/entries/{eid}",
            status="404",
        )
        == 1
    )
    records = delta("storage_node_journal_group_records_sum")
    assert records >= 13  # 12 entries and the ledger's creation, plus group start records
    assert delta("storage_node_journal_group_records_count") >= 1
    assert delta("storage_node_journal_fsync_seconds_count") == delta(
        "storage_node_journal_group_records_count"
    )
    assert _value(after, "storage_node_ledgers", state="open") == 1
    assert _value(after, "storage_node_state", state="writable") == 1
    assert _value(after, "storage_node_read_only") == 0
    assert _value(after, "storage_node_write_cache_bytes") > 0
    assert _value(after, "storage_node_disk_total_bytes", dir="journal") > 0


async def test_checkpoint_and_entry_log_metrics(client: Any) -> None:
    from node.http.state import STORAGE

    lid = (await (await client.post("/api/v1/ledgers")).json())["ledgerId"]
    await client.post(f"/api/v1/ledgers/{lid}/entries", data=b"x" * 1000, headers=OCTET)
    await client.server.app[STORAGE].checkpoint()
    samples = await scrape(client)
    assert _value(samples, "storage_node_checkpoint_duration_seconds_count") >= 1
    assert _value(samples, "storage_node_entry_logs") == 1
    assert _value(samples, "storage_node_entry_log_bytes") > 1000
    assert _value(samples, "storage_node_index_keys") >= 0
    assert _value(samples, "storage_node_index_size_bytes") > 0
    assert _value(samples, "storage_node_write_cache_bytes") == 0


async def test_gc_and_disk_metrics(tmp_path: Path, aiohttp_client: Any) -> None:
    from node.http.state import STORAGE, WORK

    settings = make_settings(
        tmp_path / "data",
        log_size_limit=64 * KiB,
        max_entry_size=16 * KiB,
        disk_emergency_reserve_bytes=KiB * KiB,  # the GC watermark of 1.0 always leaves room
    )
    client = await aiohttp_client(build_app(settings))
    storage = client.server.app[STORAGE]
    ids = [(await (await client.post("/api/v1/ledgers")).json())["ledgerId"] for _ in range(2)]
    for _ in range(8):  # interleaved: every log holds half of each ledger
        for lid in ids:
            batch = encode_batch([b"e" * 4000] * 4)
            r = await client.post(f"/api/v1/ledgers/{lid}/entries", data=batch, headers=BATCH)
            assert r.status == 201
        await storage.checkpoint()
    assert (await client.delete(f"/api/v1/ledgers/{ids[0]}")).status == 204
    await storage.checkpoint()
    r = await client.put("/api/v1/bookie/gc", json={"forceMajor": True})
    assert r.status == 200
    gc = client.server.app[WORK].gc
    for _ in range(500):
        if gc.stats.runs and not gc.in_force_gc:
            break
        await asyncio.sleep(0.01)
    samples = await scrape(client)
    assert _value(samples, "storage_node_gc_runs_total") >= 1
    assert _value(samples, "storage_node_gc_deleted_ledgers_total") == 1
    assert _value(samples, "storage_node_gc_compactions_total", kind="major") == 1
    assert _value(samples, "storage_node_gc_reclaimed_bytes_total", by="compaction") > 0
    assert _value(samples, "storage_node_gc_compaction_read_bytes_total") > 0
    assert _value(samples, "storage_node_gc_compaction_written_bytes_total") > 0
    assert 1.8 < _value(samples, "storage_node_gc_space_amplification") < 2.5  # half was dead
    assert _value(samples, "storage_node_entry_log_usage_count") >= 0
    assert _value(samples, "storage_node_gc_compacting", kind="major") == 0
    assert 0 < _value(samples, "storage_node_disk_usage_ratio", dir="ledgers") < 1
    assert _value(samples, "storage_node_read_only") == 0
    reserve = settings.data_dir / "emergency-reserve"
    assert (await asyncio.to_thread(reserve.stat)).st_size == settings.disk_emergency_reserve_bytes
    assert _value(samples, "storage_node_disk_emergency_reserve_bytes") == KiB * KiB
    (details,) = await (await client.get("/api/v1/bookie/gc_details")).json()
    assert details["majorCompactionCounter"] == 1 and 1.8 < details["spaceAmplification"] < 2.5
    # What the alerts of grafana/alerts need: a successful run's time, no failure, the live
    # ledger that pins the oldest log (the compacted logs hold only the undeleted ledger; GC
    # learns a compaction's outputs at its next run).
    runs = gc.stats.runs
    assert (await client.put("/api/v1/bookie/gc", json={})).status == 200
    for _ in range(500):
        if gc.stats.runs > runs and not gc.in_force_gc:
            break
        await asyncio.sleep(0.01)
    samples = await scrape(client)
    started = _value(samples, "storage_node_start_time_seconds")
    assert 0 < started <= _value(samples, "storage_node_gc_last_success_timestamp_seconds")
    assert _value(samples, "storage_node_gc_failures_total") == 0
    assert _value(samples, "storage_node_entry_log_oldest_live_ledgers") == 1
    pinned = _value(
        samples, "storage_node_entry_log_oldest_pinning_ledger_bytes", ledger=str(ids[1])
    )
    assert pinned > 0
    assert (
        _value(samples, "storage_node_entry_log_oldest_pinning_ledger_bytes", ledger=str(ids[0]))
        == 0
    )
    assert (
        _value(samples, "storage_node_disk_usage_warn_threshold_ratio")
        == settings.disk_usage_warn_threshold
    )
    assert (
        _value(samples, "storage_node_disk_usage_read_only_threshold_ratio")
        == settings.disk_usage_threshold
    )
    assert (
        _value(samples, "storage_node_major_compaction_interval_seconds")
        == settings.major_compaction_interval_s
    )
    assert _value(samples, "storage_node_gc_interval_seconds") == settings.gc_wait_time_ms / 1000
    assert (
        _value(samples, "storage_node_default_retention_seconds")
        == settings.default_retention_time_in_minutes * 60
    )


ROLLING = {"maxEntriesPerLedger": 3, "minLedgerRolloverTimeMinutes": 0}  # 3 entries a ledger
AGE_BOUND_S = 60  # the test's ledgers are younger than this


async def _stream_call(client: Any, method: str, path: str, **kwargs: Any) -> Any:
    r = await getattr(client, method)(f"/api/v1/{path}", **kwargs)
    assert r.status < 300, await r.text()
    return await r.json() if r.status != 204 else None


async def test_stream_metrics_move_by_the_right_amounts(client: Any) -> None:
    from node.http.state import WORK

    def stream_value(samples: dict[Any, float], name: str, **labels: str) -> float:
        return _value(samples, f"storage_node_stream_{name}", **labels)

    before = await scrape(client)
    by_size = {**ROLLING, "retentionTimeInMinutes": -1, "retentionSizeInMB": 0}
    await _stream_call(client, "put", "streams/orders", json=by_size)
    await _stream_call(client, "put", "streams/orders/cursors/c1", json={"start": "earliest"})
    positions = []
    for _ in range(6):
        body = await _stream_call(
            client, "post", "streams/orders/entries", data=b"x" * 10, headers=OCTET
        )
        positions.append(body["position"])
    await _stream_call(
        client, "post", "streams/orders/entries", data=encode_batch([b"y" * 20] * 2), headers=BATCH
    )
    # Ledgers: 3 entries of 10 bytes, 3 of 10, then the batch of 2 x 20 (not full: retention
    # runs roll full ledgers over).
    samples = await scrape(client)
    orders = {"stream": "orders"}
    c1 = {"stream": "orders", "cursor": "c1"}
    assert stream_value(samples, "append_entries_total", **orders) == 8
    assert stream_value(samples, "append_payload_bytes_total", **orders) == 6 * 10 + 40
    assert stream_value(samples, "rollovers_total", **orders) == 2
    assert stream_value(samples, "ledgers", **orders) == 3
    assert stream_value(samples, "retained_bytes", **orders) == 100
    assert stream_value(samples, "backlog_entries", **c1) == 8
    assert stream_value(samples, "backlog_bytes", **c1) == 100
    oldest = stream_value(samples, "oldest_unacknowledged_age_seconds", **c1)
    assert 0 < oldest < AGE_BOUND_S

    # Acknowledge the first two ledgers: the backlog is the third; retention (size 0) deletes
    # the two acknowledged ones.
    await _stream_call(
        client, "post", "streams/orders/cursors/c1/ack", json={"position": positions[5]}
    )
    samples = await scrape(client)
    assert stream_value(samples, "backlog_entries", **c1) == 2
    assert stream_value(samples, "backlog_bytes", **c1) == 40
    younger = stream_value(samples, "oldest_unacknowledged_age_seconds", **c1)
    assert 0 < younger <= oldest + 1  # the third ledger's age, at the next scrape
    deleted = await _stream_call(client, "post", "retention/run")
    assert len(deleted["streams"]["orders"]) == 2
    samples = await scrape(client)
    assert stream_value(samples, "retention_deleted_ledgers_total", reason="size", **orders) == 2
    assert stream_value(samples, "retention_deleted_bytes_total", reason="size", **orders) == 60
    assert stream_value(samples, "retention_deleted_ledgers_total", reason="time", **orders) == 0
    assert stream_value(samples, "ledgers", **orders) == 1
    assert stream_value(samples, "retained_bytes", **orders) == 40
    assert stream_value(samples, "backlog_entries", **c1) == 2  # backlog is never deleted
    assert stream_value(samples, "append_entries_total", **orders) == 8  # a counter
    runs = _value(samples, "storage_node_retention_runs_total")
    assert runs - _value(before, "storage_node_retention_runs_total") == 1
    assert _value(before, "storage_node_retention_last_run_timestamp_seconds") == 0  # never
    assert _value(samples, "storage_node_retention_last_run_timestamp_seconds") >= _value(
        samples, "storage_node_start_time_seconds"
    )

    # By time (0 minutes, no cursor), and by disk pressure (a forced run ignores the time).
    await _stream_call(
        client, "put", "streams/events", json={**ROLLING, "retentionTimeInMinutes": 0}
    )
    await _stream_call(client, "put", "streams/logs", json=ROLLING)
    for name in ("events", "logs"):
        for _ in range(4):
            await _stream_call(
                client, "post", f"streams/{name}/entries", data=b"z" * 5, headers=OCTET
            )
    await asyncio.sleep(0.01)  # the closed ledger of "events" is past a retention time of 0
    await _stream_call(client, "post", "retention/run")
    await client.server.app[WORK].retention.run(forced=True)
    samples = await scrape(client)
    for name, reason in (("events", "time"), ("logs", "disk")):
        labels = {"stream": name, "reason": reason}
        assert stream_value(samples, "retention_deleted_ledgers_total", **labels) == 1
        assert stream_value(samples, "retention_deleted_bytes_total", **labels) == 15
        assert stream_value(samples, "ledgers", stream=name) == 1
        assert stream_value(samples, "rollovers_total", stream=name) == 1
    assert _value(samples, "storage_node_retention_runs_total") - runs == 2

    # Everything acknowledged: no backlog, no age; a deleted stream's series are gone.
    details = await _stream_call(client, "get", "streams/orders")
    last = details["ledgers"][-1]
    await _stream_call(
        client,
        "post",
        "streams/orders/cursors/c1/ack",
        json={"position": f"{last['ledgerId']}:{last['entries'] - 1}"},
    )
    await _stream_call(client, "delete", "streams/events")
    samples = await scrape(client)
    assert ("storage_node_stream_backlog_entries", tuple(sorted(c1.items()))) in samples
    assert stream_value(samples, "backlog_entries", **c1) == 0
    assert stream_value(samples, "backlog_bytes", **c1) == 0
    assert stream_value(samples, "oldest_unacknowledged_age_seconds", **c1) == 0
    assert not any(dict(labels).get("stream") == "events" for _, labels in samples)


WAL_RING = 1 * MiB


@pytest.fixture
def wal_device(tmp_path: Path) -> Iterator[Path]:
    with loop_device(tmp_path / "wal.img", WAL_RING) as device:
        yield device


async def test_raw_device_wal_metrics_move(
    tmp_path: Path, wal_device: Path, aiohttp_client: Any
) -> None:
    """wal_kind=blockdev on a loop device: blocks and their sizes, the ring's size and use;
    then, with checkpoints held up, appends that wait for the full ring and are refused."""
    from node.http.state import STORAGE

    settings = _ring_settings(
        tmp_path, wal_device, flush_interval_ms=3_600_000, db_storage_max_throttle_time_ms=300
    )
    client = await aiohttp_client(build_app(settings))
    try:
        await _ring_metrics_move(client, client.server.app[STORAGE])
    finally:
        await client.close()  # the node lets go of the device before it is detached


def _ring_settings(tmp_path: Path, wal_device: Path, **overrides: Any) -> Settings:
    return make_settings(
        tmp_path / "data",
        wal_kind="blockdev",
        wal_path=wal_device,
        wal_capacity=WAL_RING,
        max_entry_size=32 * KiB,
        **overrides,
    )


async def test_last_log_mark_of_the_raw_device_wal(
    tmp_path: Path, wal_device: Path, aiohttp_client: Any
) -> None:
    """The ring's trim offset, where the replay would start, not a journal's lastMark file."""
    from node.http.state import STORAGE

    client = await aiohttp_client(build_app(_ring_settings(tmp_path, wal_device)))
    try:
        storage = client.server.app[STORAGE]
        lid = (await (await client.post("/api/v1/ledgers")).json())["ledgerId"]
        r = await client.post(f"/api/v1/ledgers/{lid}/entries", data=b"x" * 1000, headers=OCTET)
        assert r.status == 201
        await storage.checkpoint(force=True)
        mark = await (await client.get("/api/v1/bookie/last_log_mark")).json()
        assert storage.last_checkpoint_mark.offset > 0
        assert mark == {
            f"LastLogMark: WAL {wal_device}": f"Pos - {storage.last_checkpoint_mark.offset}"
        }
    finally:
        await client.close()


async def _ring_metrics_move(client: Any, storage: Any) -> None:
    def delta(name: str, **labels: str) -> float:
        return _value(after, name, **labels) - _value(before, name, **labels)

    before = await scrape(client)
    assert _value(before, "storage_node_wal_ring_capacity_bytes") == WAL_RING - HEADER_AREA
    lid = (await (await client.post("/api/v1/ledgers")).json())["ledgerId"]
    for _ in range(10):  # one at a time: a block each
        r = await client.post(f"/api/v1/ledgers/{lid}/entries", data=b"x" * 1000, headers=OCTET)
        assert r.status == 201
    after = await scrape(client)
    blocks = delta("storage_node_wal_block_bytes_count")
    assert blocks >= 11  # the ledger's creation and ten entries
    assert delta("storage_node_wal_block_bytes_bucket", le="4096.0") == blocks  # 4 KiB each
    assert delta("storage_node_wal_block_bytes_sum") == blocks * 4096
    assert _value(after, "storage_node_wal_ring_used_bytes") >= 11 * 4096
    assert ("storage_node_wal_blocks_in_flight", ()) in after
    assert _value(after, "storage_node_wal_blocks_in_flight") == 0  # all acknowledged
    assert delta("storage_node_wal_throttled_appends_total") == 0

    # The checkpoint thread held: once the ring is full, appends wait, then are refused.
    gate = threading.Event()
    held = storage._flush_executor.submit(gate.wait)
    try:
        before = after
        responses = await asyncio.gather(
            *(
                client.post(f"/api/v1/ledgers/{lid}/entries", data=b"y" * 20_000, headers=OCTET)
                for _ in range(60)  # 1.2 MB: more than the ring holds
            )
        )
        statuses = [r.status for r in responses]
        after = await scrape(client)
    finally:
        gate.set()
        await asyncio.wrap_future(held)
    refused = statuses.count(503)
    assert refused and refused + statuses.count(201) == len(statuses), statuses
    assert delta("storage_node_wal_rejected_appends_total") == refused
    assert delta("storage_node_wal_throttled_appends_total") >= refused
    assert _value(after, "storage_node_wal_ring_used_bytes") > (WAL_RING - HEADER_AREA) // 2
    r = await client.post(f"/api/v1/ledgers/{lid}/entries", data=b"z", headers=OCTET)
    assert r.status == 201  # the checkpoint went on and trimmed


async def test_orphan_ledgers_with_entries_are_kept_and_counted(
    tmp_path: Path, aiohttp_client: Any
) -> None:
    """A ledger tagged with a stream that does not exist, holding an entry: start() keeps it
    (it may be acknowledged data) and the operator sees it in a gauge."""
    settings = make_settings(tmp_path / "data")
    client = await aiohttp_client(build_app(settings))
    # Through the storage: the 'stream' property is the streams layer's, not a client's.
    storage = client.server.app[STORAGE]
    meta, _ = await storage.create_ledger(properties={"stream": "gone"})
    lid = meta.ledger_id
    await storage.add_entry(lid, None, b"kept")
    assert _value(await scrape(client), "storage_node_stream_orphan_ledgers") == 0
    await client.close()

    client = await aiohttp_client(build_app(settings))
    assert _value(await scrape(client), "storage_node_stream_orphan_ledgers") == 1
    r = await client.get(f"/api/v1/ledgers/{lid}/entries/0")
    assert r.status == 200 and await r.read() == b"kept"
    assert (await client.delete(f"/api/v1/ledgers/{lid}")).status == 204  # the operator's call
    assert _value(await scrape(client), "storage_node_stream_orphan_ledgers") == 0
