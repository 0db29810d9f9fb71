"""``python -m node bench write``: durable adds of the engine against the disk and RocksDB.

What is measured, per entry size, on the disk under ``--dir`` (or a temporary directory):

1. **engine**: the real ``LedgerStorage`` in-process (journal group commit, write cache,
   checkpoints to entry logs and the RocksDB index, all of it), driven like a BookKeeper
   client: ``--writers`` writers, each with its own ledger and ``--window`` adds in flight
   (one slot coroutine per in-flight add, so there is no task creation per add). An add's
   latency runs from the call to ``add_entry`` until it returns, i.e. until the fdatasync that
   covers it. Figures count the adds completed in ``--seconds`` after a short warm-up.
   **engine, batches of N** (``--batch``, 0 to leave it out): the same writers, each keeping
   one ``add_entries`` of N entries in flight, as a client that batches (Pulsar's producer,
   Kafka's) sends them; its latency is the batch's. Each run starts on a fresh data directory.
2. **raw disk (same batches)**: one thread doing sequential ``pwrite`` + ``fdatasync`` on one
   file preallocated in the journal's steps, each write as large as the engine's average
   journal group during run 1 (rounded up to the journal alignment). The journal writes its
   groups one at a time in exactly this pattern, so this is the ceiling the disk gives the
   engine for its own batching: engine/raw-disk says how much the Python side costs.
   Entries/s and MB/s are payload equivalents (batches/s * entries per group) so that they
   compare with the engine's row; the journal bytes/s of both are printed below the table.
   The engine also writes every entry a second time (entry log at checkpoints, same disk),
   so for large entries, where the disk is the limit, about half this row is its ceiling.
3. **rocksdb sync**: RocksDB through rocksdict, ``--writers`` threads each doing ``put`` with
   ``sync=True`` of 16-byte (writer, seq) keys and payloads of the same size: the usual
   "just use RocksDB with a synced WAL" alternative. Caveat printed with the table: rocksdict
   keeps the GIL during ``put`` (no ``allow_threads`` around the write), so the threads are
   serialised and RocksDB never sees concurrent writers to group-commit.
4. **rocksdb sync, N-put batches**: therefore also one thread writing ``WriteBatch`` es of
   ``--writers`` puts with ``sync=True``: what RocksDB's own group commit would at best make
   of N concurrent synced writers, without the binding in the way. A fairer ceiling for it.

Scratch data goes to a fresh subdirectory (of ``--dir`` when given), one per run, deleted as
soon as the run is measured; everything the bench created is removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import shutil
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from node.bench.common import (
    MB,
    P50,
    P99,
    PAYLOAD_FILL,
    AddLoad,
    Phase,
    Result,
    UsageError,
    latency_buffer,
    machine_line,
    markdown_table,
    parse_sizes,
    require_positive,
    scratch_dir,
    warmup_for,
)
from node.runtime import run, tune
from node.settings import KiB, MiB, Settings, SettingsError, load
from node.storage.journal import Journal
from node.storage.journalformat import RECORD_HEADER as JOURNAL_RECORD_HEADER
from node.storage.ledgers import LedgerStorage

ROCKSDB_KEY = struct.Struct(">QQ")  # (writer id, seq), 16 bytes big-endian

ENGINE = "engine"
RAW_DISK = "raw disk (same batches)"
ROCKSDB = "rocksdb sync"


# --- results -------------------------------------------------------------------------------


@dataclass(slots=True)
class EngineFigures:
    """What the engine's journal and counters did during the measured window."""

    groups: int
    journal_bytes: int
    checkpoints: int
    # The checkpoints that completed in the window (whole, even begun before it): entries
    # flushed and time in the flush thread.
    flushed_entries: int
    flush_s: float
    throttled_adds: int
    rejected_adds: int
    # CPU seconds in the window: the event loop's thread, where every add's Python runs, and
    # the whole process (journal writer, checkpoint, RocksDB threads too).
    loop_cpu_s: float
    process_cpu_s: float

    @property
    def avg_group_bytes(self) -> float:
        return self.journal_bytes / self.groups if self.groups else 0.0

    def cpu_line(self, result: Result, per: str) -> str:
        """Where the CPU went: what a single event loop can do is the ceiling of this row."""
        seconds = result.seconds or float("inf")  # an empty window shows zeros
        per_entry_us = self.loop_cpu_s / result.entries * 1e6 if result.entries else 0.0
        return (
            f"event loop {self.loop_cpu_s / seconds:.2f} of a core, {per_entry_us:.1f} us of "
            f"its CPU per {per}; the process {self.process_cpu_s / seconds:.2f} cores"
        )

    def flush_line(self, result: Result) -> str:
        """The checkpoints' flush thread: the part BookKeeper's ~250K/s figure is of."""
        rate = self.flushed_entries / self.flush_s if self.flush_s else 0.0
        busy = self.flush_s / result.seconds if result.seconds else 0.0
        return (
            f"{self.checkpoints} checkpoints flushed {self.flushed_entries:,} entries in "
            f"{self.flush_s:.2f} s: {rate:,.0f} entries/s of flush thread time, busy "
            f"{busy:.0%} of the window"
        )


# --- run 1: the engine ---------------------------------------------------------------------


async def _engine_run(
    settings: Settings,
    size: int,
    writers: int,
    window: int,
    seconds: float,
    warmup: float,
    batch: int = 1,
) -> tuple[Result, EngineFigures]:
    storage = LedgerStorage(settings)
    await storage.start()
    try:
        wal = storage._wal
        if not isinstance(wal, Journal):
            raise SettingsError("bench write measures the file journal: set wal_kind=journal")
        ledger_ids = [(await storage.create_ledger())[0].ledger_id for _ in range(writers)]
        load = AddLoad(storage, ledger_ids, window, bytes([PAYLOAD_FILL]) * size, batch)
        await asyncio.sleep(warmup)
        groups0, bytes0 = wal.groups_written, wal.bytes_written
        stats = storage.stats
        stats0, rejected0 = dataclasses.replace(stats), load.rejected
        cpu0 = (time.thread_time(), time.process_time())  # this coroutine runs on the loop
        elapsed = await load.record(seconds)
        loop_cpu_s, process_cpu_s = time.thread_time() - cpu0[0], time.process_time() - cpu0[1]
        groups1, bytes1 = wal.groups_written, wal.bytes_written
        figures = EngineFigures(
            groups=groups1 - groups0,
            journal_bytes=bytes1 - bytes0,
            checkpoints=stats.checkpoints - stats0.checkpoints,
            flushed_entries=stats.flushed_entries - stats0.flushed_entries,
            flush_s=stats.flush_seconds_total - stats0.flush_seconds_total,
            throttled_adds=stats.throttled_adds - stats0.throttled_adds,
            rejected_adds=load.rejected - rejected0,
            loop_cpu_s=loop_cpu_s,
            process_cpu_s=process_cpu_s,
        )
        if figures.groups == 0:  # a window shorter than one group: use the whole run
            figures.groups, figures.journal_bytes = groups1, bytes1
        await load.stop()
    finally:
        await storage.close()
    merged = load.take()
    entries = len(merged) * batch
    name = ENGINE if batch == 1 else f"{ENGINE}, batches of {batch}"
    return Result(name, entries, entries * size, elapsed, merged), figures


# --- run 2: the raw disk with the engine's batches ------------------------------------------


def _back_to_back(
    write: Callable[[], float], seconds: float, warmup: float
) -> tuple[list[float], float]:
    """Runs 2 and 4: ``write`` back to back for ``warmup`` + ``seconds``, one thread. ``write``
    returns when its timed part started; it ends when ``write`` returns. Returns the
    latencies of the writes started after the warm-up and the time they took."""
    latencies: list[float] = []
    clock = time.perf_counter
    record_from = clock() + warmup
    stop_at = record_from + seconds
    first = last = 0.0
    while last < stop_at:
        started = write()
        last = clock()
        if started >= record_from:
            if not latencies:
                first = started
            latencies.append(last - started)
    return latencies, last - first if latencies else 0.0


def _raw_disk_run(
    path: Path,
    batch_bytes: int,
    entries_per_batch: float,
    size: int,
    seconds: float,
    warmup: float,
    prealloc_step: int,
) -> tuple[Result, int]:
    """Sequential pwrite + fdatasync of ``batch_bytes`` into a file preallocated in
    ``prealloc_step`` steps, as the journal does. Returns the result and the bytes written
    in the measured window."""
    data = bytes([PAYLOAD_FILL]) * batch_bytes
    clock = time.perf_counter
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    position = allocated = 0

    def write() -> float:
        nonlocal position, allocated
        started = clock()
        if position + batch_bytes > allocated:
            allocated = ((position + batch_bytes) // prealloc_step + 1) * prealloc_step
            os.posix_fallocate(fd, 0, allocated)
        os.pwrite(fd, data, position)
        os.fdatasync(fd)
        position += batch_bytes
        return started

    try:
        latencies, elapsed = _back_to_back(write, seconds, warmup)
    finally:
        os.close(fd)
    entries = len(latencies) * entries_per_batch
    return (
        Result(RAW_DISK, entries, entries * size, elapsed, latencies),
        len(latencies) * batch_bytes,
    )


# --- run 3 and 4: RocksDB -------------------------------------------------------------------


def _rocksdb_threads_run(
    path: Path, size: int, writers: int, seconds: float, warmup: float
) -> Result:
    """``writers`` threads, each doing synced puts back to back."""
    from rocksdict import Options, Rdict, WriteOptions

    db = Rdict(str(path), Options(raw_mode=True))
    write_options = WriteOptions()
    write_options.sync = True
    payload = bytes([PAYLOAD_FILL]) * size
    phase = Phase()
    latencies = [latency_buffer() for _ in range(writers)]

    def writer(writer_id: int) -> None:
        put, pack, clock = db.put, ROCKSDB_KEY.pack, time.perf_counter
        record = latencies[writer_id].append
        seq = 0
        while phase.running:
            key = pack(writer_id, seq)
            seq += 1
            started = clock()
            put(key, payload, write_options)
            finished = clock()
            if phase.recording:
                record(finished - started)

    threads = [
        threading.Thread(target=writer, args=(i,), name=f"bench-rocksdb-{i}", daemon=True)
        for i in range(writers)
    ]
    try:
        for thread in threads:
            thread.start()
        time.sleep(warmup)
        elapsed = phase.record_blocking(seconds)
    finally:
        phase.running = False
        for thread in threads:
            thread.join()
        db.close()
    merged = [x for per_writer in latencies for x in per_writer]
    return Result(ROCKSDB, len(merged), len(merged) * size, elapsed, merged)


def _rocksdb_batched_run(
    path: Path, size: int, per_batch: int, seconds: float, warmup: float
) -> Result:
    """One thread writing synced WriteBatches of ``per_batch`` puts: RocksDB's group commit
    of ``per_batch`` concurrent writers at its best. Latency is per batch."""
    from rocksdict import Options, Rdict, WriteBatch, WriteOptions

    db = Rdict(str(path), Options(raw_mode=True))
    write_options = WriteOptions()
    write_options.sync = True
    payload = bytes([PAYLOAD_FILL]) * size
    clock, pack = time.perf_counter, ROCKSDB_KEY.pack
    seq = 0

    def write() -> float:
        nonlocal seq
        batch = WriteBatch(raw_mode=True)
        for writer_id in range(per_batch):
            batch.put(pack(writer_id, seq), payload)
        seq += 1
        started = clock()
        db.write(batch, write_options)
        return started

    try:
        latencies, elapsed = _back_to_back(write, seconds, warmup)
    finally:
        db.close()
    entries = len(latencies) * per_batch
    name = f"{ROCKSDB}, {per_batch}-put batches"
    return Result(name, entries, entries * size, elapsed, latencies)


# --- driver and report ---------------------------------------------------------------------


@dataclass(slots=True)
class SizeReport:
    size: int
    rows: list[Result]
    figures: EngineFigures
    batched: tuple[Result, EngineFigures] | None  # the batched engine row, with --batch
    batch_bytes: int
    entries_per_group: float
    engine_journal_mb_s: float
    raw_journal_mb_s: float

    def row(self, name: str) -> Result:
        return next(r for r in self.rows if r.name == name)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "n/a"


def _table(rows: list[Result]) -> list[str]:
    header = ("run", "entries/s", "MB/s", "p50 ms", "p99 ms")
    cells = [
        (
            r.name,
            f"{r.entries_per_s:,.0f}",
            f"{r.mb_per_s:,.1f}",
            f"{r.latency_ms(P50):.2f}",
            f"{r.latency_ms(P99):.2f}",
        )
        for r in rows
    ]
    return markdown_table(header, cells)


def _print_size(report: SizeReport, writers: int) -> None:
    engine, raw, rocks = report.row(ENGINE), report.row(RAW_DISK), report.row(ROCKSDB)
    rocks_batched = report.rows[-1]
    f = report.figures
    batched_line = []
    if report.batched:
        batched, batched_figures = report.batched
        batched_line += [
            f"- {batched.name}: {batched_figures.groups:,} groups, "
            f"avg {batched_figures.avg_group_bytes:,.0f} B; "
            f"batched/engine: {_ratio(batched.mb_per_s, engine.mb_per_s)}; "
            f"{batched_figures.cpu_line(batched, 'entry')}",
            f"- {batched.name}, flush thread: {batched_figures.flush_line(batched)}",
        ]
    out = [
        "",
        f"### entry size {report.size:,} B",
        "",
        *_table(report.rows),
        "",
        f"- engine/rocksdb: {_ratio(engine.mb_per_s, rocks.mb_per_s)}; "
        f"engine/raw-disk: {_ratio(engine.mb_per_s, raw.mb_per_s)}; "
        f"engine/rocksdb-batched: {_ratio(engine.mb_per_s, rocks_batched.mb_per_s)} (MB/s)",
        f"- engine journal: {f.groups:,} groups, avg {f.avg_group_bytes:,.0f} B "
        f"= {report.entries_per_group:.1f} entries/group; "
        f"{report.engine_journal_mb_s:,.1f} MB/s of journal bytes; "
        f"{f.throttled_adds:,} throttled and "
        f"{f.rejected_adds:,} rejected adds in the window",
        f"- engine CPU: {f.cpu_line(engine, 'add')}",
        f"- engine flush thread: {f.flush_line(engine)}",
        *batched_line,
        f"- raw disk: {report.batch_bytes:,} B per write+fdatasync, "
        f"{report.raw_journal_mb_s:,.1f} MB/s of journal bytes",
        f"- rocksdb sync: {writers} threads, but rocksdict holds the GIL in put(), so they are "
        f"serialised (no group commit); the batched row is one thread, {writers} puts per "
        "synced WriteBatch",
    ]
    print("\n".join(out), flush=True)


def _print_summary(reports: list[SizeReport]) -> None:
    header = (
        "| size B | engine entries/s | engine MB/s | batched entries/s | engine/rocksdb "
        "| engine/raw-disk |"
    )
    rows = [
        f"| {r.size:,} | {r.row(ENGINE).entries_per_s:,.0f} | {r.row(ENGINE).mb_per_s:,.1f} "
        f"| {f'{r.batched[0].entries_per_s:,.0f}' if r.batched else '-'} "
        f"| {_ratio(r.row(ENGINE).mb_per_s, r.row(ROCKSDB).mb_per_s)} "
        f"| {_ratio(r.row(ENGINE).mb_per_s, r.row(RAW_DISK).mb_per_s)} |"
        for r in reports
    ]
    rule = "|---:|---:|---:|---:|---:|---:|"
    print("\n".join(["", "### summary", "", header, rule, *rows]))


def _bench_size(
    scratch: Path, size: int, writers: int, window: int, batch: int, seconds: float, warmup: float
) -> SizeReport:
    run_dir = scratch / f"engine-{size}"
    settings = load(data_dir=run_dir)
    tune()  # as `serve` does
    try:
        engine, figures = run(_engine_run(settings, size, writers, window, seconds, warmup))
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    batched = None
    if batch:
        try:
            batched = run(_engine_run(settings, size, writers, 1, seconds, warmup, batch))
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)
    align = settings.journal_alignment_size
    batch_bytes = max(align, -(-int(figures.avg_group_bytes) // align) * align)
    entries_per_group = figures.avg_group_bytes / (size + JOURNAL_RECORD_HEADER.size)

    raw_path = scratch / f"raw-{size}.bin"
    try:
        raw, raw_bytes = _raw_disk_run(
            raw_path,
            batch_bytes,
            entries_per_group,
            size,
            seconds,
            warmup,
            settings.journal_pre_alloc_size,
        )
    finally:
        raw_path.unlink(missing_ok=True)

    rocks_dir = scratch / f"rocksdb-{size}"
    try:
        rocks = _rocksdb_threads_run(rocks_dir, size, writers, seconds, warmup)
    finally:
        shutil.rmtree(rocks_dir, ignore_errors=True)
    try:
        rocks_batched = _rocksdb_batched_run(rocks_dir, size, writers, seconds, warmup)
    finally:
        shutil.rmtree(rocks_dir, ignore_errors=True)

    rows = [engine, *([batched[0]] if batched else []), raw, rocks, rocks_batched]
    for row in rows:
        row.sort_latencies()
    return SizeReport(
        size=size,
        rows=rows,
        figures=figures,
        batched=batched,
        batch_bytes=batch_bytes,
        entries_per_group=entries_per_group,
        engine_journal_mb_s=figures.journal_bytes / engine.seconds / MB if engine.seconds else 0,
        raw_journal_mb_s=raw_bytes / raw.seconds / MB if raw.seconds else 0.0,
    )


def main(args: argparse.Namespace) -> int:
    writers, window, seconds = int(args.writers), int(args.window), float(args.seconds)
    require_positive(writers=writers, window=window, seconds=seconds)
    batch = int(args.batch)
    if batch < 0 or batch == 1:
        raise UsageError("--batch must be 0 (no batched row) or at least 2")
    defaults = load()
    sizes = parse_sizes("--sizes", str(args.sizes), defaults.max_entry_size, "max_entry_size")
    warmup = warmup_for(seconds)
    with scratch_dir(args.dir, "node-bench-") as scratch:
        print(
            "\n".join(
                [
                    f"## node bench write: {writers} writers x {window} adds in flight"
                    + (f" (batched: x 1 batch of {batch})" if batch else "")
                    + f", {seconds:g} s per run after {warmup:g} s warm-up",
                    "",
                    machine_line(scratch),
                    f"- engine settings: journal_max_group_wait_ms="
                    f"{defaults.journal_max_group_wait_ms:g}, "
                    f"journal_buffered_writes_threshold="
                    f"{defaults.journal_buffered_writes_threshold // KiB} KiB, "
                    f"journal_flush_when_queue_empty={defaults.journal_flush_when_queue_empty}, "
                    f"journal_alignment_size={defaults.journal_alignment_size}, "
                    f"db_storage_write_cache_max_size="
                    f"{defaults.db_storage_write_cache_max_size // MiB} MiB",
                    "- MB/s = payload bytes (10^6) per second; raw-disk figures are payload "
                    "equivalents of the engine's journal groups",
                ]
            ),
            flush=True,
        )
        reports = []
        for size in sizes:
            report = _bench_size(scratch, size, writers, window, batch, seconds, warmup)
            _print_size(report, writers)
            reports.append(report)
        _print_summary(reports)
    return 0
