"""Ledger storage, in-process, on real files and a real RocksDB."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from pathlib import Path

import pytest

from node.settings import Settings
from node.storage import entrylog, journal, journalformat, logformat
from node.storage.clock import SystemClock
from node.storage.errors import (
    Backpressure,
    EntryConflict,
    EntryNotFound,
    EntryTooLarge,
    LedgerClosed,
    LedgerExists,
    LedgerFenced,
    LedgerFull,
    LedgerNotFound,
    WriteTokenMismatch,
)
from node.storage.faults import Faults
from node.storage.index import MAX_ID, LedgerState, OffloadInfo, OffloadState
from node.storage.ledgers import LedgerStorage
from node.storage.wal import record_crc
from tests.harness.settings import make_settings


async def _reopen(storage: LedgerStorage) -> LedgerStorage:
    await storage.close()
    again = LedgerStorage(storage.settings)
    await again.start()
    return again


async def test_add_read_range_and_metadata(storage: LedgerStorage) -> None:
    meta, created = await storage.create_ledger(properties={"app": "orders"})
    assert created and meta.state == LedgerState.OPEN
    ids = [await storage.add_entry(meta.ledger_id, None, f"e{i}".encode()) for i in range(5)]
    assert ids == [0, 1, 2, 3, 4]
    assert await storage.read_entry(meta.ledger_id, 3) == b"e3"
    got = [(e, p) async for e, p in storage.read_range(meta.ledger_id, 1, 3)]
    assert got == [(1, b"e1"), (2, b"e2"), (3, b"e3")]
    assert storage.ledger(meta.ledger_id).lac == 4
    assert storage.ledger(meta.ledger_id).entries == 5
    assert storage.ledger(meta.ledger_id).payload_bytes == 10


async def test_everything_survives_a_graceful_restart_which_replays_nothing(
    storage: LedgerStorage,
) -> None:
    await storage.create_ledger(7, {"k": "v"}, "secret")
    await storage.add_entries(7, [bytes([i]) * i for i in range(50)], "secret")
    await storage.fence(7, "secret")  # a ledger with a write token asks for it
    other, _ = await storage.create_ledger()
    await storage.add_entry(other.ledger_id, None, b"x")
    await storage.close_ledger(other.ledger_id)
    storage = await _reopen(storage)
    try:
        assert storage.stats.replayed_records == 0
        assert storage.ledger(7).state == LedgerState.FENCED
        assert storage.ledger(7).lac == 49 and storage.ledger(7).properties == {"k": "v"}
        assert storage.ledger(other.ledger_id).state == LedgerState.CLOSED
        for i in range(50):
            assert await storage.read_entry(7, i) == bytes([i]) * i
        created, _ = await storage.create_ledger()
        assert created.ledger_id > other.ledger_id  # ids are never handed out twice
    finally:
        await storage.close()


async def test_same_bytes_again_is_idempotent_different_bytes_conflict(
    storage: LedgerStorage,
) -> None:
    meta, _ = await storage.create_ledger()
    lid = meta.ledger_id
    await storage.add_entry(lid, 0, b"same")
    assert await storage.add_entry(lid, 0, b"same") == 0  # from the write cache
    with pytest.raises(EntryConflict):
        await storage.add_entry(lid, 0, b"other")
    await storage.checkpoint()
    assert await storage.add_entry(lid, 0, b"same") == 0  # from the entry log
    with pytest.raises(EntryConflict):
        await storage.add_entry(lid, 0, b"other")
    assert storage.ledger(lid).entries == 1


async def test_lac_stops_at_a_hole_and_jumps_when_it_is_filled(storage: LedgerStorage) -> None:
    meta, _ = await storage.create_ledger()
    lid = meta.ledger_id
    await storage.add_entry(lid, 0, b"a")
    await storage.add_entry(lid, 2, b"c")
    await storage.add_entry(lid, 3, b"d")
    assert storage.ledger(lid).lac == 0
    assert await storage.read_entry(lid, 3) == b"d"  # durable past the hole: readable
    with pytest.raises(EntryNotFound):
        await storage.read_entry(lid, 1)
    await storage.checkpoint()
    storage = await _reopen(storage)  # the hole survives a restart, as do the ids after it
    try:
        assert storage.ledger(lid).lac == 0
        await storage.add_entry(lid, 1, b"b")
        assert storage.ledger(lid).lac == 3
        got = [e async for e, _ in storage.read_range(lid, 0)]
        assert got == [0, 1, 2, 3]
    finally:
        await storage.close()


async def test_fence_close_delete_and_write_token(storage: LedgerStorage) -> None:
    a, _ = await storage.create_ledger()
    await storage.add_entry(a.ledger_id, None, b"1")
    assert await storage.fence(a.ledger_id) == 0
    with pytest.raises(LedgerFenced):
        await storage.add_entry(a.ledger_id, None, b"2")
    assert await storage.read_entry(a.ledger_id, 0) == b"1"  # reads still served

    b, _ = await storage.create_ledger()
    await storage.close_ledger(b.ledger_id)
    with pytest.raises(LedgerClosed):
        await storage.add_entry(b.ledger_id, None, b"x")

    c, _ = await storage.create_ledger(write_token="t0ken")
    with pytest.raises(WriteTokenMismatch):
        await storage.add_entry(c.ledger_id, None, b"x")
    with pytest.raises(WriteTokenMismatch):
        await storage.add_entry(c.ledger_id, None, b"x", "wrong")
    assert await storage.add_entry(c.ledger_id, None, b"x", "t0ken") == 0

    await storage.delete_ledger(a.ledger_id)
    with pytest.raises(LedgerNotFound):
        await storage.read_entry(a.ledger_id, 0)
    with pytest.raises(LedgerExists):
        await storage.create_ledger(a.ledger_id)
    with pytest.raises(EntryTooLarge):
        await storage.add_entry(
            c.ledger_id, None, bytes(storage.settings.max_entry_size + 1), "t0ken"
        )


async def test_fence_close_and_delete_ask_for_the_write_token(storage: LedgerStorage) -> None:
    fenced, _ = await storage.create_ledger(write_token="t0ken")
    closed, _ = await storage.create_ledger(write_token="t0ken")
    deleted, _ = await storage.create_ledger(write_token="t0ken")
    for token in (None, "wrong"):
        with pytest.raises(WriteTokenMismatch):
            await storage.fence(fenced.ledger_id, token)
        with pytest.raises(WriteTokenMismatch):
            await storage.close_ledger(closed.ledger_id, token)
        with pytest.raises(WriteTokenMismatch):
            await storage.delete_ledger(deleted.ledger_id, token)
    assert {m.state for m in (fenced, closed, deleted)} == {LedgerState.OPEN}
    await storage.fence(fenced.ledger_id, "t0ken")
    await storage.close_ledger(closed.ledger_id, "t0ken")
    await storage.delete_ledger(deleted.ledger_id, "t0ken")
    assert (fenced.state, closed.state, deleted.state) == (
        LedgerState.FENCED, LedgerState.CLOSED, LedgerState.DELETED,
    )  # fmt: skip
    # A ledger without a token (a stream's) needs none, as before.
    plain, _ = await storage.create_ledger()
    await storage.close_ledger(plain.ledger_id)
    await storage.delete_ledger(plain.ledger_id)


async def test_deleted_ledger_stays_deleted_after_crash_replay(tmp_path: Path) -> None:
    settings = make_settings(tmp_path / "d", flush_interval_ms=3_600_000)
    storage = LedgerStorage(settings)
    await storage.start()
    meta, _ = await storage.create_ledger()
    await storage.add_entry(meta.ledger_id, None, b"gone")
    await storage.delete_ledger(meta.ledger_id)
    # Simulate a crash: drop the engine without its final checkpoint; the journal has it all.
    await storage._wal.close()
    storage._close_files()
    again = LedgerStorage(settings)
    await again.start()
    try:
        assert again.stats.replayed_records >= 3
        with pytest.raises(LedgerNotFound):
            again.ledger(meta.ledger_id)
    finally:
        await again.close()


async def test_appends_past_the_last_entry_id_leave_nothing_behind(tmp_path: Path) -> None:
    settings = make_settings(tmp_path / "d", flush_interval_ms=3_600_000)
    storage = LedgerStorage(settings)
    await storage.start()
    meta, _ = await storage.create_ledger()
    await storage.add_entry(meta.ledger_id, MAX_ID - 1, b"a")
    cached = storage.write_cache_bytes
    with pytest.raises(LedgerFull):  # its first entry fits, its second does not
        await storage.add_entries(meta.ledger_id, [b"b", b"c"])
    assert storage.write_cache_bytes == cached
    assert (meta.entries, meta.payload_bytes, meta.last_entry_id) == (1, 1, MAX_ID - 1)
    await storage.add_entry(meta.ledger_id, MAX_ID, b"z")
    with pytest.raises(LedgerFull):
        await storage.add_entry(meta.ledger_id, None, b"y")
    with pytest.raises(LedgerFull):
        await storage.add_entries(meta.ledger_id, [b"y"])
    assert await storage.add_entries(meta.ledger_id, []) == []  # nothing asked, nothing refused
    # A crash: the journal alone tells what was acknowledged.
    await storage._wal.close()
    storage._close_files()
    again = LedgerStorage(settings)
    await again.start()
    try:
        assert again.stats.replayed_records == 3  # the creation and the two entries added
        replayed = again.ledger(meta.ledger_id)
        assert (replayed.entries, replayed.payload_bytes) == (2, 2)
        got = [(e, p) async for e, p in again.read_range(meta.ledger_id, MAX_ID - 1)]
        assert got == [(MAX_ID - 1, b"a"), (MAX_ID, b"z")]
    finally:
        await again.close()


def _first_log_contents(
    ledgers_dir: Path,
) -> tuple[list[int], tuple[int, int], dict[int, int], dict[int, int]]:
    """(log ids, the first log's map fields, its ledgers map, bytes per ledger by scan)."""
    logs = entrylog.list_logs(ledgers_dir)
    sealed = logformat.log_path(ledgers_dir, logs[0])
    _version, map_offset, map_count = logformat.decode_header(
        sealed.read_bytes()[: logformat.HEADER_SIZE]
    )
    scanned: dict[int, int] = {}
    maps: dict[int, int] = {}
    for record in entrylog.scan(sealed):
        assert record.crc_ok
        if record.ledger_id == logformat.LEDGERS_MAP_LEDGER_ID:
            maps.update(logformat.decode_ledgers_map(record.payload))
        else:
            size = logformat.RECORD_OVERHEAD + len(record.payload)
            scanned[record.ledger_id] = scanned.get(record.ledger_id, 0) + size
    return logs, (map_offset, map_count), maps, scanned


async def test_entry_logs_roll_with_ledgers_map_and_reads_cross_them(tmp_path: Path) -> None:
    settings = make_settings(tmp_path / "d", log_size_limit=64 * 1024, max_entry_size=16 * 1024)
    storage = LedgerStorage(settings)
    await storage.start()
    try:
        ledgers = [(await storage.create_ledger())[0].ledger_id for _ in range(3)]
        for round_ in range(4):
            for lid in ledgers:
                await storage.add_entries(lid, [bytes([lid, round_]) * 2000 for _ in range(10)])
            await storage.checkpoint()
        logs, map_fields, maps, scanned = await asyncio.to_thread(
            _first_log_contents, settings.ledgers_dir
        )
        assert len(logs) >= 3
        map_offset, map_count = map_fields
        assert map_offset > 0 and map_count >= 1
        assert maps == scanned  # the map tells GC what a scan would
        storage = await _reopen(storage)
        for lid in ledgers:
            got = [p async for _, p in storage.read_range(lid, 0)]
            assert got == [bytes([lid, r]) * 2000 for r in range(4) for _ in range(10)]
    finally:
        await storage.close()


async def test_read_ahead_fills_the_read_cache(storage: LedgerStorage) -> None:
    meta, _ = await storage.create_ledger()
    await storage.add_entries(meta.ledger_id, [bytes([i % 256]) * 100 for i in range(300)])
    await storage.checkpoint()
    storage = await _reopen(storage)
    try:
        cache = storage.read_cache
        assert await storage.read_entry(meta.ledger_id, 0) == bytes([0]) * 100
        misses = cache.misses
        for i in range(1, 300):
            assert await storage.read_entry(meta.ledger_id, i) == bytes([i % 256]) * 100
        assert cache.misses == misses  # all 299 followers came from one read-ahead
    finally:
        await storage.close()


async def test_half_full_write_cache_triggers_a_checkpoint(tmp_path: Path) -> None:
    settings = make_settings(
        tmp_path / "d", db_storage_write_cache_max_size=2 << 20, flush_interval_ms=3_600_000
    )
    storage = LedgerStorage(settings)
    await storage.start()
    try:
        meta, _ = await storage.create_ledger()
        before = storage.stats.checkpoints
        await storage.add_entries(meta.ledger_id, [bytes(64 * 1024)] * 20)  # 1.25 MiB
        for _ in range(200):
            if storage.stats.checkpoints > before:
                break
            await asyncio.sleep(0.01)
        assert storage.stats.checkpoints > before
        assert storage.write_cache_bytes < settings.db_storage_write_cache_max_size // 2
    finally:
        await storage.close()


async def test_checkpoints_count_the_entries_they_flush_and_their_flush_time(
    storage: LedgerStorage,
) -> None:
    """bench write's flush thread line: entries and seconds of the checkpoints' flushes."""
    meta, _ = await storage.create_ledger()
    await storage.checkpoint()  # the creation alone: no entry to flush
    stats = storage.stats
    assert stats.flushed_entries == 0
    seconds_before = stats.flush_seconds_total
    await storage.add_entries(meta.ledger_id, [b"a" * 100] * 300)
    await storage.add_entry(meta.ledger_id, None, b"b")
    await storage.checkpoint()
    assert stats.flushed_entries == 301
    assert stats.flush_seconds_total > seconds_before  # an entry log write and its fsync
    await storage.checkpoint()  # nothing new: no checkpoint at all
    assert stats.flushed_entries == 301


async def test_full_cache_during_a_slow_flush_throttles_then_refuses(tmp_path: Path) -> None:
    settings = make_settings(
        tmp_path / "d",
        db_storage_write_cache_max_size=2 << 20,
        db_storage_max_throttle_time_ms=200,
        flush_interval_ms=3_600_000,
    )
    storage = LedgerStorage(settings)
    await storage.start()
    release = threading.Event()
    try:
        meta, _ = await storage.create_ledger()
        storage._flush_executor.submit(release.wait)  # the flush thread is stuck (slow disk)
        await storage.add_entries(meta.ledger_id, [bytes(64 * 1024)] * 20)  # swap: flushing
        await asyncio.sleep(0.05)
        await storage.add_entries(meta.ledger_id, [bytes(64 * 1024)] * 20)  # fills the other
        with pytest.raises(Backpressure):
            await storage.add_entry(meta.ledger_id, None, b"refused")
        assert storage.stats.rejected_adds == 1
        waiting = asyncio.create_task(storage.add_entry(meta.ledger_id, None, b"waits"))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        release.set()
        assert await asyncio.wait_for(waiting, 10) == 40  # admitted once the flush is done
    finally:
        release.set()
        await storage.close()


async def test_long_poll_lac(storage: LedgerStorage) -> None:
    """A poll returns once the LAC passes ``after`` (not at its own timeout: the outer wait
    is shorter), or the current LAC when its timeout comes first."""
    meta, _ = await storage.create_ledger()
    lid = meta.ledger_id
    assert await storage.wait_lac(lid, -1, 0.05) == -1  # timeout: the current LAC
    waiter = asyncio.create_task(storage.wait_lac(lid, 0, 60))
    await storage.add_entry(lid, None, b"0")
    await asyncio.sleep(0.01)
    assert not waiter.done()  # the LAC is 0: not past it
    await storage.add_entry(lid, None, b"1")
    assert await asyncio.wait_for(waiter, 30) == 1


async def test_long_polls_that_time_out_or_are_cancelled_are_forgotten(
    storage: LedgerStorage,
) -> None:
    """On a ledger no add comes to, polls that end without an answer keep nothing (a flood
    of them held memory until the ledger's next add)."""
    meta, _ = await storage.create_ledger()
    lid = meta.ledger_id
    timed_out = [storage.wait_lac(lid, 5, 0.05) for _ in range(100)]
    cancelled = [asyncio.create_task(storage.wait_lac(lid, 5, 60)) for _ in range(100)]
    waiting = asyncio.create_task(storage.wait_lac(lid, -1, 60))
    assert await asyncio.gather(*timed_out) == [-1] * 100
    await asyncio.sleep(0)
    assert storage.lac_waiters == 101
    for task in cancelled:
        task.cancel()
    await asyncio.gather(*cancelled, return_exceptions=True)
    assert storage.lac_waiters == 1 and len(storage._lac._waiters[lid]) == 1
    await storage.add_entry(lid, None, b"0")
    assert await asyncio.wait_for(waiting, 5) == 0
    assert lid not in storage._lac._waiters


async def test_journals_rotate_and_old_ones_are_trimmed(tmp_path: Path) -> None:
    settings: Settings = make_settings(
        tmp_path / "d",
        journal_max_size=64 * 1024,
        journal_pre_alloc_size=64 * 1024,
        journal_max_backups=1,
    )
    storage = LedgerStorage(settings)
    await storage.start()
    try:
        meta, _ = await storage.create_ledger()
        for _ in range(10):
            await storage.add_entries(meta.ledger_id, [bytes(8000)] * 10)
        assert len(await asyncio.to_thread(journalformat.list_journals, settings.journal_dir)) > 5
        await storage.checkpoint()
        ids = await asyncio.to_thread(journalformat.list_journals, settings.journal_dir)
        mark = await asyncio.to_thread(journalformat.read_last_mark, settings.ledgers_dir)
        assert [i for i in ids if i < mark.log_id] == [mark.log_id - 1]  # one backup kept
    finally:
        await storage.close()


async def test_filling_a_hole_of_a_ledger_with_a_write_token(storage: LedgerStorage) -> None:
    meta, _ = await storage.create_ledger(write_token="t")
    await storage.add_entry(meta.ledger_id, 0, b"a", "t")
    await storage.add_entry(meta.ledger_id, 2, b"c", "t")
    await storage.checkpoint()  # the hole is looked up in the index, not only the cache
    with pytest.raises(WriteTokenMismatch):
        await storage.add_entry(meta.ledger_id, 1, b"b", "wrong")
    await storage.add_entry(meta.ledger_id, 1, b"b", "t")
    assert storage.ledger(meta.ledger_id).lac == 2


async def test_allocation_after_a_client_took_the_highest_id(storage: LedgerStorage) -> None:
    await storage.create_ledger((1 << 63) - 1)
    first, _ = await storage.create_ledger()
    second, _ = await storage.create_ledger()
    assert (first.ledger_id, second.ledger_id) == (0, 1)


async def test_a_purged_ledger_id_is_never_allocated_again(storage: LedgerStorage) -> None:
    ids = [(await storage.create_ledger())[0].ledger_id for _ in range(3)]
    await storage.delete_ledger(ids[-1])  # the highest id
    await storage.checkpoint()
    assert await storage.purge_deleted_ledgers() == [ids[-1]]  # gone from the index
    storage = await _reopen(storage)
    try:
        meta, _ = await storage.create_ledger()
        assert meta.ledger_id == ids[-1] + 1, "a client may still hold the purged id"
        with pytest.raises(LedgerNotFound):
            storage.ledger(ids[-1])
    finally:
        await storage.close()


async def test_read_ahead_over_records_larger_than_its_read_step(tmp_path: Path) -> None:
    # Read cache segments of 2 MiB, so that every entry here fits in one.
    settings = make_settings(tmp_path / "d", db_storage_read_ahead_cache_max_size=16 << 20)
    storage = LedgerStorage(settings)
    await storage.start()
    meta, _ = await storage.create_ledger()
    sizes = [300_000, 10, 700_000, 5, 260_000, 1]  # around and over the 256 KiB step
    payloads = [bytes([i + 1]) * n for i, n in enumerate(sizes)]
    await storage.add_entries(meta.ledger_id, payloads)
    await storage.checkpoint()
    storage = await _reopen(storage)
    try:
        assert await storage.read_entry(meta.ledger_id, 0) == payloads[0]
        misses = storage.read_cache.misses
        for i, payload in enumerate(payloads):
            assert await storage.read_entry(meta.ledger_id, i) == payload
        assert storage.read_cache.misses == misses  # read ahead, in steps, byte for byte
    finally:
        await storage.close()


async def test_a_cancelled_add_harms_neither_its_group_nor_the_lac(storage: LedgerStorage) -> None:
    meta, _ = await storage.create_ledger()
    first = asyncio.create_task(storage.add_entry(meta.ledger_id, None, b"a"))
    second = asyncio.create_task(storage.add_entry(meta.ledger_id, None, b"b"))
    await asyncio.sleep(0)  # both appends are in one journal group
    first.cancel()
    results = await asyncio.gather(first, second, return_exceptions=True)
    assert isinstance(results[0], asyncio.CancelledError) and results[1] == 1
    await asyncio.sleep(0.05)
    assert storage.ledger(meta.ledger_id).lac == 1  # the abandoned entry still counts
    assert await storage.read_entry(meta.ledger_id, 0) == b"a"
    assert await asyncio.wait_for(storage.add_entry(meta.ledger_id, None, b"c"), 5) == 2


async def test_a_long_replay_flushes_as_it_goes_and_loses_or_doubles_nothing(
    tmp_path: Path,
) -> None:
    """Replay hands chunks of the write cache to a flush thread while it scans on. Adds
    of every shape (batches, singles, a hole filled later), state changes in between, and
    records journaled twice (met again after their chunk went to the flush) come back
    exactly: the same bytes, counts, LAC and states, after the replay and after a graceful
    restart that reads them from the entry logs and the index."""
    data = tmp_path / "d"
    writer = LedgerStorage(make_settings(data, flush_interval_ms=3_600_000))
    await writer.start()
    ledgers = [(await writer.create_ledger())[0].ledger_id for _ in range(3)]
    expected: dict[int, dict[int, bytes]] = {lid: {} for lid in ledgers}
    for round_ in range(40):
        for n, lid in enumerate(ledgers):
            payloads = [bytes([round_, n, i]) * 300 for i in range(10)]
            if n == 1:
                ids = [await writer.add_entry(lid, None, p) for p in payloads]
            else:
                ids = await writer.add_entries(lid, payloads)
            expected[lid].update(zip(ids, payloads, strict=True))
    hole_ledger = ledgers[2]
    after = max(expected[hole_ledger])
    for entry_id in (after + 3, after + 1, after + 2):  # one ahead, then the hole filled
        expected[hole_ledger][entry_id] = f"hole {entry_id}".encode() * 50
        await writer.add_entry(hole_ledger, entry_id, expected[hole_ledger][entry_id])
    await writer.close_ledger(ledgers[0])
    gone, _ = await writer.create_ledger()
    await writer.add_entries(gone.ledger_id, [b"x" * 1000] * 20)
    await writer.delete_ledger(gone.ledger_id)
    before = {lid: dataclasses.replace(writer.ledger(lid)) for lid in ledgers}
    await writer._wal.close()  # a crash: the journal holds everything, the entry logs nothing
    writer._close_files()

    # Journal every entry of one ledger a second time, in a journal of its own after the
    # first: replay meets them when their first copies are flushed or being flushed.
    again = journal.Journal(make_settings(data), SystemClock(), Faults())
    await again.start()
    for entry_id, payload in sorted(expected[ledgers[1]].items()):
        crc = record_crc(ledgers[1], entry_id, payload)
        last = again.append(ledgers[1], entry_id, crc, payload)
    await last
    await again.close()

    # A small write cache: replay flushes in chunks of 256 KiB, a dozen of them.
    settings = make_settings(data, db_storage_write_cache_max_size=2 << 20)
    for graceful_restarts in range(2):
        storage = LedgerStorage(settings)
        await storage.start()
        try:
            if graceful_restarts == 0:
                assert storage.stats.replayed_records > sum(map(len, expected.values()))
                logs = await asyncio.to_thread(entrylog.list_logs, settings.ledgers_dir)
                assert len(logs) >= 1
            else:
                assert storage.stats.replayed_records == 0
            with pytest.raises(LedgerNotFound):
                storage.ledger(gone.ledger_id)
            for lid in ledgers:
                meta = storage.ledger(lid)
                was = before[lid]
                assert (meta.entries, meta.payload_bytes, meta.lac, meta.state) == (
                    was.entries, was.payload_bytes, was.lac, was.state,
                )  # fmt: skip
                got = dict([(e, p) async for e, p in storage.read_range(lid, 0)])
                assert got == expected[lid]
        finally:
            await storage.close()


async def test_an_offload_record_never_puts_a_lac_ahead_of_the_locations_in_the_index(
    storage: LedgerStorage,
) -> None:
    """The record is written to the index at once; the ledger's entries were still in the
    write cache, so the index said LAC 1 with no location for entries 0 and 1 (an audit
    snapshot of the live node found them as holes)."""
    meta, _ = await storage.create_ledger()
    lid = meta.ledger_id
    await storage.add_entry(lid, None, b"a")
    await storage.add_entry(lid, None, b"bc")
    await storage.close_ledger(lid)
    await storage.record_offload(lid, OffloadInfo(OffloadState.IN_PROGRESS, "attempt"))
    stored = storage.index.load_ledgers()[lid]
    assert stored.lac == 1 and stored.offload is not None
    assert list(storage.index.entry_ids(lid)) == [0, 1]
