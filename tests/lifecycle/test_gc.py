"""Garbage collection on real entry logs, a real index and real files."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from node.lifecycle.disks import DiskMonitor
from node.lifecycle.gc import GarbageCollector
from node.settings import Settings, load
from node.storage import entrylog, logformat
from node.storage.clock import SystemClock
from node.storage.compaction import Throttle
from node.storage.ledgers import LedgerStorage
from tests.harness.clock import ON_FAKE_CLOCK, FakeClock
from tests.lifecycle.gc_world import (
    check_survivors,
    cut_ledgers_map,
    dangling_entries,
    gc_settings,
    interleave,
    log_bytes,
    payload,
)


def _fake_clock(storage: LedgerStorage) -> FakeClock:
    clock = storage._clock
    assert isinstance(clock, FakeClock)
    return clock


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[tuple[LedgerStorage, GarbageCollector]]:
    clock = FakeClock()
    storage = LedgerStorage(gc_settings(tmp_path / "d", **ON_FAKE_CLOCK), clock=clock)
    await storage.start()
    yield storage, GarbageCollector(storage, clock)
    await storage.close()


async def _delete(storage: LedgerStorage, ledgers: list[int]) -> None:
    for lid in ledgers:
        await storage.delete_ledger(lid)
    await storage.checkpoint()  # the deletions are durable: GC may forget the ledgers


async def test_logs_of_deleted_ledgers_disappear(
    world: tuple[LedgerStorage, GarbageCollector],
) -> None:
    storage, gc = world
    short = await interleave(storage, ledgers=4, rounds=10)
    long = await interleave(storage, ledgers=2, rounds=10)  # in later logs only
    logs_before = await asyncio.to_thread(entrylog.list_logs, storage.settings.ledgers_dir)
    await _delete(storage, short)
    report = await gc.run()
    assert sorted(report.purged_ledgers) == sorted(short)
    assert report.deleted_logs, "logs holding only deleted ledgers must go"
    assert report.compaction is None  # not due: no interval has passed
    logs_after = await asyncio.to_thread(entrylog.list_logs, storage.settings.ledgers_dir)
    assert set(logs_after) == set(logs_before) - set(report.deleted_logs)
    await check_survivors(storage, long)
    assert await dangling_entries(storage) == []
    assert gc.stats.deleted_ledgers == 4 and gc.stats.reclaimed_by_deletion_bytes > 0


async def test_minor_and_major_compaction_thresholds(
    world: tuple[LedgerStorage, GarbageCollector],
) -> None:
    storage, gc = world
    settings = storage.settings
    ids = await interleave(storage, ledgers=10, rounds=12)
    # Every log holds a slice of each of the 10 ledgers: deleting 5 leaves logs 50% live.
    await _delete(storage, ids[:5])
    clock = _fake_clock(storage)
    clock.advance(settings.minor_compaction_interval_s + 1)
    report = await gc.run()
    assert report.compaction == "minor" and report.result.compacted == []  # 0.5 > 0.2
    before = await asyncio.to_thread(log_bytes, settings.ledgers_dir)
    clock.advance(settings.major_compaction_interval_s + 1)
    report = await gc.run()
    assert report.compaction == "major" and report.result.compacted  # 0.5 < 0.8
    after = await asyncio.to_thread(log_bytes, settings.ledgers_dir)
    # Half of each log was dead: the disk gives back close to half (headers and maps aside).
    assert after < before * 0.6, (before, after)
    await check_survivors(storage, ids[5:])
    assert await dangling_entries(storage) == []
    # Delete 4 of the 5 left: a fifth of each compacted log stays live, and a log smaller
    # than the target size counts as emptier still, so minor compaction (< 0.2) takes them.
    await _delete(storage, ids[5:9])
    clock.advance(settings.minor_compaction_interval_s + 1)
    report = await gc.run()
    assert report.compaction == "minor" and report.result.compacted
    await check_survivors(storage, ids[9:])
    assert await dangling_entries(storage) == []
    assert gc.status.minor_compaction_counter == 2 and gc.status.major_compaction_counter == 1


async def test_above_the_gc_watermark_compaction_runs_whatever_the_interval(
    tmp_path: Path,
) -> None:
    """Logs half live wait for the daily major; a disk above ``gc_disk_usage_threshold``
    (0.85) does not wait: the disk monitor's next run compacts them. The monitor is given
    usages (the host's disk is not measured), against the default watermarks."""
    defaults = load()
    watermarks = {
        name: getattr(defaults, name)
        for name in (
            "gc_disk_usage_threshold",
            "disk_usage_warn_threshold",
            "disk_usage_threshold",
            "disk_usage_lwm_threshold",
        )
    }
    settings = gc_settings(tmp_path / "d", **watermarks)
    storage = LedgerStorage(settings)
    await storage.start()
    try:
        gc = GarbageCollector(storage, SystemClock())
        await _compact_above_the_gc_watermark(storage, gc, DiskMonitor(storage, gc, SystemClock()))
    finally:
        await storage.close()


async def _compact_above_the_gc_watermark(
    storage: LedgerStorage, gc: GarbageCollector, monitor: DiskMonitor
) -> None:
    settings = storage.settings
    ids = await interleave(storage, ledgers=10, rounds=12)
    await _delete(storage, ids[:5])  # every log 50% live: below the major threshold
    below = settings.gc_disk_usage_threshold - 0.05
    monitor.apply({"journal": below, "ledgers": below, "index": below})
    report = await gc.run()
    assert report.compaction is None, "no interval is due"
    before = await asyncio.to_thread(log_bytes, settings.ledgers_dir)

    above = settings.gc_disk_usage_threshold + 0.01
    monitor.apply({"journal": below, "ledgers": above, "index": below})
    report = await gc.run()
    assert report.compaction == "major" and report.result.compacted
    assert await asyncio.to_thread(log_bytes, settings.ledgers_dir) < before * 0.6
    assert not storage.read_only_reason, "under the full watermark the node stays writable"
    await check_survivors(storage, ids[5:])
    assert await dangling_entries(storage) == []

    monitor.apply({"journal": below, "ledgers": below, "index": below})
    assert not gc.disk_pressure


async def test_space_trigger_compacts_the_emptiest_logs_until_under_the_limit(
    tmp_path: Path,
) -> None:
    limit = 1.5
    settings = gc_settings(
        tmp_path / "d", compaction_space_amplification_limit=limit, **ON_FAKE_CLOCK
    )
    storage = LedgerStorage(settings, clock=FakeClock())
    await storage.start()
    try:
        gc = GarbageCollector(storage, storage._clock)
        fuller = await interleave(storage, ledgers=10, rounds=12)
        fuller_logs = set(await asyncio.to_thread(storage.gc_candidate_logs))
        emptier = await interleave(storage, ledgers=10, rounds=12)
        emptier_logs = set(await asyncio.to_thread(storage.gc_candidate_logs)) - fuller_logs
        # 70% and 30% live (both above the minor threshold): twice the live bytes in all.
        await _delete(storage, fuller[:3] + emptier[:7])
        report = await gc.run()  # no interval has passed: only the space trigger can fire
        assert report.compaction == "space" and report.result.compacted
        assert set(report.result.compacted) <= emptier_logs, "emptiest first"
        assert set(report.result.compacted) < emptier_logs, "only as many as it takes"
        assert gc.status.space_compaction_counter == 1
        assert (await gc.run()).compaction is None  # now under the limit
        size, live = await asyncio.to_thread(_sealed_size_and_live_bytes, storage)
        assert size <= limit * live, (size, live)
        await check_survivors(storage, fuller[3:] + emptier[7:])
        assert await dangling_entries(storage) == []
    finally:
        await storage.close()


def _sealed_size_and_live_bytes(storage: LedgerStorage) -> tuple[int, int]:
    size = live = 0
    for log_id in storage.gc_candidate_logs():
        path = logformat.log_path(storage.settings.ledgers_dir, log_id)
        size += path.stat().st_size
        sizes = entrylog.ledger_sizes(path)
        live += sum(n for lid, n in sizes.items() if storage.is_live_ledger(lid))
    return size, live


async def test_the_compaction_lag_bound_survives_a_restart(tmp_path: Path) -> None:
    settings = gc_settings(tmp_path / "d", **ON_FAKE_CLOCK)
    lag_s = settings.major_compaction_interval_s
    storage = LedgerStorage(settings, clock=FakeClock())
    await storage.start()
    try:
        gc = GarbageCollector(storage, storage._clock)
        ids = await interleave(storage, ledgers=10, rounds=12)
        await _delete(storage, ids[:1])  # 90% live: no usage threshold will ever take them
        assert (await gc.run()).compaction is None  # notes when the dead data appeared
    finally:
        await storage.close()
    # Just short of the bound: the wait is not restarted by the restart, nor over yet.
    clock = FakeClock(start_s=lag_s - 60)
    storage = LedgerStorage(settings, clock=clock)
    await storage.start()
    try:
        gc = GarbageCollector(storage, clock)
        gc.request(force_minor=True)
        report = await gc.run()
        assert report.compaction == "minor" and report.result.compacted == []
        clock.advance(61)
        gc.request(force_minor=True)
        report = await gc.run()
        assert report.compaction == "minor" and report.result.compacted  # by the lag bound
        await check_survivors(storage, ids[1:])
    finally:
        await storage.close()


async def test_forced_gc_and_suspension(world: tuple[LedgerStorage, GarbageCollector]) -> None:
    storage, gc = world
    ids = await interleave(storage, ledgers=4, rounds=6)
    await _delete(storage, ids[:3])
    gc.suspend(major=True, minor=True)
    _fake_clock(storage).advance(10**6)
    assert (await gc.run()).compaction is None  # suspended, and nothing forced
    gc.request(force_major=True)  # a forced compaction overrides suspension (BookKeeper)
    assert gc.in_force_gc
    report = await gc.run()
    assert report.compaction == "major" and report.result.compacted
    assert not gc.in_force_gc
    await check_survivors(storage, ids[3:])


async def test_a_held_log_is_deleted_on_release_or_after_the_forced_interval(
    world: tuple[LedgerStorage, GarbageCollector],
) -> None:
    storage, _gc = world
    await interleave(storage, ledgers=2, rounds=20)  # three logs, the first two sealed
    logs = await asyncio.to_thread(entrylog.list_logs, storage.settings.ledgers_dir)
    first, second = logs[0], logs[1]
    reader = storage._reader
    for log_id, released in ((first, True), (second, False)):
        hold = reader._open(log_id)  # what a read does while it reads
        await asyncio.to_thread(hold.__enter__)
        assert await asyncio.to_thread(storage.retire_log, log_id) is False  # held: not yet
        path = logformat.log_path(storage.settings.ledgers_dir, log_id)
        assert await asyncio.to_thread(path.exists) and log_id in storage.retired_logs
        with pytest.raises(entrylog.LogRetired):  # no new holds on a retired log
            await asyncio.to_thread(reader._open(log_id).__enter__)
        if released:
            await asyncio.to_thread(hold.__exit__, None, None, None)
            assert not await asyncio.to_thread(path.exists)
            assert log_id not in storage.retired_logs
        else:
            assert await asyncio.to_thread(storage.reap_retired_logs) == []  # not yet 120 s
            forcibly_s = storage.settings.destroy_mapped_file_interval_forcibly_ms / 1000
            _fake_clock(storage).advance(forcibly_s)
            assert await asyncio.to_thread(storage.reap_retired_logs) == [log_id]
            assert not await asyncio.to_thread(path.exists)
            await asyncio.to_thread(hold.__exit__, None, None, None)  # a late release is fine


async def test_a_log_held_past_the_forced_interval_goes_without_waiting_for_a_run(
    tmp_path: Path,
) -> None:
    """The forced delete comes ``destroy_mapped_file_interval_forcibly_ms`` after the retirement
    (here 400 ms), not at the next GC run (an hour here; 10 minutes by default)."""
    forcibly_ms = 400
    settings = gc_settings(
        tmp_path / "d",
        destroy_mapped_file_interval_forcibly_ms=forcibly_ms,
        gc_wait_time_ms=3_600_000,
    )
    storage = LedgerStorage(settings)
    await storage.start()
    gc = GarbageCollector(storage, SystemClock())
    task = asyncio.create_task(gc.run_forever())
    try:
        await interleave(storage, ledgers=2, rounds=20)
        log_id = (await asyncio.to_thread(entrylog.list_logs, settings.ledgers_dir))[0]
        path = logformat.log_path(settings.ledgers_dir, log_id)
        hold = storage._reader._open(log_id)  # a read that never ends
        await asyncio.to_thread(hold.__enter__)
        retired_at = time.monotonic()
        assert await asyncio.to_thread(storage.retire_log, log_id) is False
        gc.request()  # a run, which finds it still held: it stays
        while await asyncio.to_thread(path.exists):
            assert time.monotonic() - retired_at < 10, "the held log was never deleted"
            await asyncio.sleep(0.02)
        held_s = time.monotonic() - retired_at
        assert forcibly_ms / 1000 <= held_s < forcibly_ms / 1000 * 1.25 + 0.5, held_s
        await asyncio.to_thread(hold.__exit__, None, None, None)
    finally:
        gc.stop()
        await task
        await storage.close()


async def test_a_read_racing_compaction_finds_the_new_copy(
    world: tuple[LedgerStorage, GarbageCollector],
) -> None:
    storage, gc = world
    ids = await interleave(storage, ledgers=4, rounds=6)
    await _delete(storage, ids[:3])
    gc.request(force_major=True)
    run = asyncio.create_task(gc.run())
    while not run.done():  # reads all along the compaction, never a wrong byte
        await check_survivors(storage, ids[3:])
        storage.read_cache._segments = [{} for _ in storage.read_cache._segments]
        await asyncio.sleep(0)
    assert (await run).result.compacted
    await check_survivors(storage, ids[3:])


async def test_an_unreadable_log_is_skipped_and_reported(
    world: tuple[LedgerStorage, GarbageCollector],
) -> None:
    storage, gc = world
    ids = await interleave(storage, ledgers=3, rounds=12)
    logs = await asyncio.to_thread(entrylog.list_logs, storage.settings.ledgers_dir)
    victim = logformat.log_path(storage.settings.ledgers_dir, logs[0])
    await asyncio.to_thread(_clobber_header, victim)
    await _delete(storage, ids[:2])
    report = await gc.run()
    assert gc.status.unreadable_logs == [logs[0]]
    assert "bad entry log header" in gc.status.last_errors[logs[0]]
    assert await asyncio.to_thread(victim.exists)  # never deleted blind
    assert report.purged_ledgers  # and GC went on with the rest
    details = gc.status.as_bookkeeper()
    assert details["unreadableLogs"] == [f"{logs[0]:x}"]


def _clobber_header(path: Path) -> None:
    with open(path, "r+b") as f:
        f.write(b"JUNK")


async def _logs_a_crash_left(
    tmp_path: Path, entries: int, delete: bool = True, **overrides: Any
) -> tuple[LedgerStorage, dict[int, dict[int, int]]]:
    """A started storage over logs as a crash leaves the checkpoint's log: records up to the
    end and no ledgers map. Two ledgers of ``entries`` entries each, interleaved in one log
    (its limit is large), and (``delete``) deleted durably: the log holds nothing live.
    Returns the storage and the maps the logs were sealed with, by log id."""
    settings = _crash_left_settings(tmp_path, **overrides)
    storage = LedgerStorage(settings)
    await storage.start()
    ids = [(await storage.create_ledger())[0].ledger_id for _ in range(2)]
    for first in range(0, entries, 500):
        for lid in ids:
            await storage.add_entries(lid, [payload(lid, e) for e in range(first, first + 500)])
    await storage.close()  # seals the log: its map is cut off below
    maps = await asyncio.to_thread(_cut_ledgers_maps, settings.ledgers_dir)
    storage = LedgerStorage(settings)
    await storage.start()
    if delete:
        await _delete(storage, ids)
    return storage, maps


def _crash_left_settings(tmp_path: Path, **overrides: Any) -> Settings:
    return gc_settings(tmp_path / "d", log_size_limit=64 << 20, **overrides)


def _cut_ledgers_maps(directory: Path) -> dict[int, dict[int, int]]:
    """Every log's map cut off (``cut_ledgers_map``), by log id."""
    return {
        log_id: cut_ledgers_map(logformat.log_path(directory, log_id))
        for log_id in entrylog.list_logs(directory)
    }


def _log_sizes(directory: Path) -> dict[int, int]:
    return {
        log_id: logformat.log_path(directory, log_id).stat().st_size
        for log_id in entrylog.list_logs(directory)
    }


async def test_a_log_a_crash_left_without_its_map_is_reclaimed_by_the_first_run(
    tmp_path: Path,
) -> None:
    """GC reads such a log whole to learn its ledgers. With the default throttles that must
    not go at compaction's pace, 1,000 entries/s (6 s for these 6,000 entries; 17 minutes for
    a 1 GB log of 1 KiB entries), but at ``gc_read_rate_by_bytes``: 32 MiB/s, 6 MB here."""
    defaults = load()
    storage, _maps = await _logs_a_crash_left(
        tmp_path, 3000, compaction_rate_by_entries=defaults.compaction_rate_by_entries
    )
    try:
        logs = await asyncio.to_thread(_log_sizes, storage.settings.ledgers_dir)
        gc = GarbageCollector(storage, SystemClock())
        started = time.monotonic()
        report = await gc.run()
        elapsed = time.monotonic() - started
        assert set(logs) <= set(report.deleted_logs), "the log holds no live ledger"
        at_compaction_rate = 6000 / defaults.compaction_rate_by_entries
        assert elapsed < at_compaction_rate / 2, f"{elapsed:.1f} s for 6,000 entries"
    finally:
        await storage.close()


async def test_the_scan_of_a_log_without_its_map_is_paced_in_bytes(tmp_path: Path) -> None:
    rate = 2_000_000  # bytes/s: the log below holds about 3 MB of records
    storage, _maps = await _logs_a_crash_left(tmp_path, 1500, gc_read_rate_by_bytes=rate)
    try:
        logs = await asyncio.to_thread(_log_sizes, storage.settings.ledgers_dir)
        scanned = sum(logs.values())
        gc = GarbageCollector(storage, SystemClock())
        started = time.monotonic()
        report = await gc.run()
        elapsed = time.monotonic() - started
        assert set(logs) <= set(report.deleted_logs)
        assert scanned > rate  # long enough to measure
        assert abs(scanned / elapsed - rate) / rate < 0.10, f"{scanned / elapsed:,.0f} B/s"
    finally:
        await storage.close()


def _kept_maps(directory: Path) -> dict[int, dict[int, int] | None]:
    """The maps kept beside the logs, by log id (None: one that does not hold)."""
    kept: dict[int, dict[int, int] | None] = {}
    for path in directory.glob(f"*{logformat.SUFFIX}{logformat.MAP_FILE_SUFFIX}"):
        log = path.with_suffix("")
        kept[int(log.stem, 16)] = entrylog.read_map_file(log, log.stat().st_size)
    return kept


async def test_what_the_scan_learns_is_kept_and_the_next_start_reads_no_log(
    tmp_path: Path,
) -> None:
    """The first run after the crash reads the log whole, once; the map it learns is kept
    beside the log, equal to the map the crash cut off. After a restart GC knows the log
    without reading it (at 1,000 B/s here, a read of its 3 MB would take an hour), and the
    kept map goes with its log."""
    storage, sealed_with = await _logs_a_crash_left(tmp_path, 1500, delete=False)
    directory = storage.settings.ledgers_dir
    try:
        logs = await asyncio.to_thread(_log_sizes, directory)
        assert set(logs) == set(sealed_with)
        gc = GarbageCollector(storage, SystemClock())
        await gc.run()
        records = sum(size - logformat.HEADER_SIZE for size in logs.values())
        assert gc.stats.scanned_bytes == records
        assert await asyncio.to_thread(_kept_maps, directory) == sealed_with
    finally:
        await storage.close()

    storage = LedgerStorage(_crash_left_settings(tmp_path, gc_read_rate_by_bytes=1000))
    await storage.start()
    try:
        gc = GarbageCollector(storage, SystemClock())
        await asyncio.wait_for(gc.run(), timeout=30)
        assert gc.stats.scanned_bytes == 0
        assert gc.known_logs() >= len(logs)
        await _delete(storage, [m.ledger_id for m in storage.ledgers()])
        report = await asyncio.wait_for(gc.run(), timeout=30)
        assert set(logs) <= set(report.deleted_logs)
        assert await asyncio.to_thread(_kept_maps, directory) == {}
    finally:
        await storage.close()


async def test_a_kept_map_that_does_not_hold_is_read_again_and_orphans_go(
    tmp_path: Path,
) -> None:
    storage, sealed_with = await _logs_a_crash_left(tmp_path, 500, delete=False)
    directory = storage.settings.ledgers_dir
    try:
        await GarbageCollector(storage, SystemClock()).run()
        (log_id,) = sealed_with
        assert await asyncio.to_thread(_kept_maps, directory) == sealed_with
        kept = logformat.map_file_path(logformat.log_path(directory, log_id))
        orphan = logformat.map_file_path(logformat.log_path(directory, 0x7FFF_0000))
        partial = kept.with_name(kept.name + ".tmp")

        def spoil() -> None:
            data = kept.read_bytes()
            kept.write_bytes(data[:-1] + bytes([data[-1] ^ 0x40]))  # rot in the last record
            orphan.write_bytes(data)  # its log is gone (a crash between the two deletions)
            partial.write_bytes(data[:10])  # a crash while keeping a map

        await asyncio.to_thread(spoil)
        gc = GarbageCollector(storage, SystemClock())  # as after a restart: nothing in memory
        await gc.run()
        logs = await asyncio.to_thread(_log_sizes, directory)
        assert gc.stats.scanned_bytes == logs[log_id] - logformat.HEADER_SIZE, "read again"
        assert await asyncio.to_thread(_kept_maps, directory) == sealed_with, "and kept again"
        assert not await asyncio.to_thread(orphan.exists)
        assert not await asyncio.to_thread(partial.exists)
    finally:
        await storage.close()


async def test_a_map_that_cannot_be_kept_costs_only_the_next_read(tmp_path: Path) -> None:
    """Keeping the map fails (a directory where its file is written stands in for a full
    disk): GC still learns the log from its read and reclaims it."""
    storage, sealed_with = await _logs_a_crash_left(tmp_path, 500)
    directory = storage.settings.ledgers_dir
    try:
        (log_id,) = sealed_with
        kept = logformat.map_file_path(logformat.log_path(directory, log_id))
        await asyncio.to_thread((kept.parent / f"{kept.name}.tmp").mkdir)
        gc = GarbageCollector(storage, SystemClock())
        report = await gc.run()
        assert log_id in report.deleted_logs
        assert gc.stats.scanned_bytes > 0
        assert gc.status.unreadable_logs == []
    finally:
        await storage.close()


def test_throttle_keeps_compaction_io_within_ten_percent_of_the_rate() -> None:
    rate = 4_000_000.0  # bytes/s
    throttle = Throttle(rate, by_bytes=True)
    started = time.monotonic()
    moved = 0
    while moved < 6_000_000:  # reads and writes of ~1 KiB records, as compaction does
        throttle.acquire(1, 1024)
        moved += 1024
    measured = moved / (time.monotonic() - started)
    assert abs(measured - rate) / rate < 0.10, f"{measured:,.0f} B/s against {rate:,.0f}"


async def test_compaction_io_is_throttled_end_to_end(tmp_path: Path) -> None:
    rate = 200_000  # bytes/s: the compaction below moves ~300 KB
    settings = gc_settings(tmp_path / "d", is_throttle_by_bytes=True, compaction_rate_by_bytes=rate)
    storage = LedgerStorage(settings)
    await storage.start()
    try:
        gc = GarbageCollector(storage, SystemClock())
        ids = await interleave(storage, ledgers=4, rounds=12)
        await _delete(storage, ids[:2])
        await gc.run()  # learn the logs (from their maps: almost no I/O)
        gc.request(force_major=True)
        started = time.monotonic()
        report = await gc.run()
        elapsed = time.monotonic() - started
        io = report.result.bytes_read + report.result.bytes_written
        assert io > rate  # long enough to measure
        assert abs(io / elapsed - rate) / rate < 0.10, f"{io / elapsed:,.0f} B/s, {rate:,}"
        await check_survivors(storage, ids[2:])
    finally:
        await storage.close()


async def test_compaction_by_entries_reads_at_the_read_rate_and_counts_its_copies(
    tmp_path: Path,
) -> None:
    """Counting entries (the default), compaction charges the entries it copies to
    ``compaction_rate_by_entries`` and reads at ``gc_read_rate_by_bytes``: a mostly dead log
    of small entries is not read at 1,000 entries/s (3.3 s here instead of 1.5 s; 17 minutes
    for a GB of 1 KiB entries). Two rates, each kept: the slower one sets the time."""
    read_rate, entry_rate = 2_000_000, load().compaction_rate_by_entries
    settings = gc_settings(
        tmp_path / "d",
        log_size_limit=64 << 20,
        gc_read_rate_by_bytes=read_rate,
        compaction_rate_by_entries=entry_rate,
    )
    storage = LedgerStorage(settings)
    await storage.start()
    try:
        keep, drop = [(await storage.create_ledger())[0].ledger_id for _ in range(2)]
        for first in range(0, 300, 100):  # one live entry in ten, all in one log
            await storage.add_entries(keep, [payload(keep, e) for e in range(first, first + 100)])
            more = range(first * 9, (first + 100) * 9)
            await storage.add_entries(drop, [payload(drop, e) for e in more])
        storage = await _restart(storage)  # seals the log: a candidate now
        await _delete(storage, [drop])
        gc = GarbageCollector(storage, SystemClock())
        await gc.run()  # learn the log (from its map: almost no I/O)
        gc.request(force_major=True)
        started = time.monotonic()
        report = await gc.run()
        elapsed = time.monotonic() - started
        result = report.result
        assert result.entries_copied == 300
        expected = max(result.bytes_read / read_rate, result.entries_copied / entry_rate)
        assert result.bytes_read > read_rate  # long enough to measure
        assert abs(elapsed - expected) / expected < 0.15, f"{elapsed:.2f} s, {expected:.2f}"
        await check_survivors(storage, [keep])
    finally:
        await storage.close()


async def _restart(storage: LedgerStorage) -> LedgerStorage:
    """Close (which seals the current log, however small) and start again on the same dirs."""
    await storage.close()
    again = LedgerStorage(storage.settings, clock=storage._clock)
    await again.start()
    return again


def _log_files(ledgers_dir: Path) -> dict[int, tuple[int, int]]:
    """(inode, size) of each entry log: a rewritten log would change either."""
    found = {}
    for log_id in entrylog.list_logs(ledgers_dir):
        stat = logformat.log_path(ledgers_dir, log_id).stat()
        found[log_id] = (stat.st_ino, stat.st_size)
    return found


async def test_major_compaction_never_rewrites_logs_without_dead_data(tmp_path: Path) -> None:
    clock = FakeClock()
    storage = LedgerStorage(gc_settings(tmp_path / "d", **ON_FAKE_CLOCK), clock=clock)
    await storage.start()
    try:
        # Three sealed logs far below the target size (usage under the major threshold),
        # all of them live: copying them frees nothing, whatever their usage says.
        kept: list[int] = []
        for ledgers in (1, 1, 2):
            kept += await interleave(storage, ledgers=ledgers, rounds=2)
            storage = await _restart(storage)
        gc = GarbageCollector(storage, clock)
        directory = storage.settings.ledgers_dir
        assert (await gc.run()).compaction is None  # learns the logs; nothing is due
        sealed = set(await asyncio.to_thread(storage.gc_candidate_logs))
        assert len(sealed) == 3 and len(gc.usages()) == 3
        assert max(gc.usages()) < storage.settings.major_compaction_threshold
        files = await asyncio.to_thread(_log_files, directory)
        for _ in range(2):
            gc.request(force_major=True)
            report = await gc.run()
            assert report.compaction == "major" and report.result.compacted == []
            assert await asyncio.to_thread(_log_files, directory) == files
        assert gc.stats.compaction_read_bytes == gc.stats.compaction_written_bytes == 0
        assert gc.stats.reclaimed_by_compaction_bytes == 0
        # A log with dead data is still compacted, and only that one.
        doomed = kept.pop()
        shared = max(sealed)  # the log of the last two ledgers
        await _delete(storage, [doomed])
        gc.request(force_major=True)
        report = await gc.run()
        assert report.result.compacted == [shared]
        assert report.result.reclaimed_bytes > 0
        left = await asyncio.to_thread(_log_files, directory)
        assert {i: files[i] for i in sealed - {shared}}.items() <= left.items()
        await check_survivors(storage, kept)
        assert await dangling_entries(storage) == []
    finally:
        await storage.close()


async def test_tiny_live_logs_do_not_fire_the_space_trigger(tmp_path: Path) -> None:
    limit = 1.25
    settings = gc_settings(
        tmp_path / "d", compaction_space_amplification_limit=limit, **ON_FAKE_CLOCK
    )
    storage = LedgerStorage(settings, clock=FakeClock())
    await storage.start()
    try:
        for _ in range(3):  # logs of a node restarted often: headers weigh as much as data
            await interleave(storage, ledgers=1, rounds=1)
            storage = await _restart(storage)
        gc = GarbageCollector(storage, storage._clock)
        for _ in range(2):
            assert (await gc.run()).compaction is None
        assert gc.status.space_amplification > limit  # all of it headers and maps
        assert gc.status.space_compaction_counter == 0
    finally:
        await storage.close()
