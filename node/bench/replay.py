"""``python -m node bench replay``: how fast a node comes back after a crash with a long
journal to replay, against reading the same journal bytes and checking their CRCs.

Twice, for two journals: a child process adds ``--replay-mib`` MiB of 1 KiB entries to 16
ledgers, in batches of 100 (batch records in the journal) or one by one (64 adds in flight
per ledger: a record per entry), with checkpoints held off, then dies without closing
(``os._exit``: what SIGKILL leaves, every acknowledged record in the journal and nothing in
the entry logs). Then, in this process:
- the node's start with default settings: open the index, replay the journal from the last
  mark (flushing to entry logs as the write cache fills), and the checkpoint after replay;
- the journal scan alone (``Journal.replay``: read, frame, CRC check, gather runs, no
  state);
- the baseline: the journal files read sequentially with one CRC32C over each 1 MiB.

Each is timed on a warm page cache (the files were just written or read), so the figures
are the node's own cost, not the disk's. MB/s are of the entries' payload bytes (what the
journal holds beyond them is framing: headers, batch tables, group starts, padding).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import crc32c

from node.bench.common import MB, UsageError, markdown_table, require_positive, scratch_dir
from node.bench.server import BATCH_ENTRIES, ENTRY_SIZE
from node.runtime import run, tune
from node.settings import MiB, Settings, load
from node.storage.clock import SystemClock
from node.storage.faults import Faults
from node.storage.journal import Journal
from node.storage.journalformat import list_journals
from node.storage.ledgers import LedgerStorage
from node.storage.wal import EntryRun

LEDGERS = 16
READ_CHUNK = 1 * MiB  # the baseline's read and CRC unit
HELD_OFF_MS = 3_600_000  # the writer's checkpoint period: none happens while it writes
SINGLE_ADDS_IN_FLIGHT = 64  # per ledger, when the journal is written one add at a time
SHAPES = ((BATCH_ENTRIES, f"batches of {BATCH_ENTRIES}"), (1, "single adds"))


def _writer_settings(data_dir: Path, mib: int) -> Settings:
    # A write cache that holds it all, so that no checkpoint moves the mark.
    cache = max(64 * MiB, 4 * mib * MiB)
    return load(
        data_dir=data_dir, flush_interval_ms=HELD_OFF_MS, db_storage_write_cache_max_size=cache
    )


async def _write(data_dir: Path, mib: int, batch_entries: int) -> None:
    storage = LedgerStorage(_writer_settings(data_dir, mib))
    await storage.start()
    ledgers = [(await storage.create_ledger())[0].ledger_id for _ in range(LEDGERS)]
    payload = os.urandom(ENTRY_SIZE)
    batch = [payload] * batch_entries
    batches = mib * MiB // (ENTRY_SIZE * batch_entries)

    async def writer(ledger_id: int, count: int) -> None:
        if batch_entries > 1:
            for _ in range(count):
                await storage.add_entries(ledger_id, batch)
            return
        for start in range(0, count, SINGLE_ADDS_IN_FLIGHT):  # ids in order, a window at once
            adds = min(SINGLE_ADDS_IN_FLIGHT, count - start)
            await asyncio.gather(
                *(storage.add_entry(ledger_id, None, payload) for _ in range(adds))
            )

    share = [batches // LEDGERS + (n < batches % LEDGERS) for n in range(LEDGERS)]
    await asyncio.gather(*(writer(lid, n) for lid, n in zip(ledgers, share, strict=True)))
    os._exit(0)  # a crash: no final checkpoint, the journal holds everything acknowledged


def writer_main(argv: list[str]) -> None:
    data_dir, mib, batch_entries = argv
    run(_write(Path(data_dir), int(mib), int(batch_entries)))


async def _start(data_dir: Path) -> tuple[float, int]:
    storage = LedgerStorage(load(data_dir=data_dir))
    started = time.perf_counter()
    await storage.start()
    elapsed = time.perf_counter() - started
    records = storage.stats.replayed_records
    await storage.close()
    return elapsed, records


def _scan(settings: Settings) -> tuple[float, int]:
    journal = Journal(settings, SystemClock(), Faults())
    started = time.perf_counter()
    replayed = journal.replay(journal.last_mark())
    records = sum(len(r.payloads) if isinstance(r, EntryRun) else 1 for r, _crc in replayed)
    return time.perf_counter() - started, records


def _read(paths: list[Path]) -> float:
    started = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(READ_CHUNK):
                crc32c.crc32c(chunk)
    return time.perf_counter() - started


def _measure(scratch: Path, mib: int, batch_entries: int) -> tuple[Path, list[Path], float, int]:
    """Write a journal in this shape (a child that then dies), then time its scan and the
    node's start on it: (data dir, journal files, scan seconds, records scanned)."""
    data_dir = scratch / f"data-{batch_entries}"
    subprocess.run(
        [sys.executable, "-m", __name__, str(data_dir), str(mib), str(batch_entries)], check=True
    )
    settings = load(data_dir=data_dir)
    paths = [settings.journal_dir / f"{i:x}.txn" for i in list_journals(settings.journal_dir)]
    if not paths:
        raise UsageError("the writer left no journal")
    scan_s, scanned = _scan(settings)
    return data_dir, paths, scan_s, scanned


def main(args: argparse.Namespace) -> int:
    mib = args.replay_mib
    require_positive(replay_mib=mib)
    tune()
    with scratch_dir(args.dir, "node-bench-replay-") as scratch:
        print(f"## node bench replay: {mib} MiB of {ENTRY_SIZE} B entries in the journal")
        rows: list[tuple[str, float, int]] = []
        rates: list[str] = []
        entry_bytes = 0
        for batch_entries, shape in SHAPES:
            data_dir, paths, scan_s, scanned = _measure(scratch, mib, batch_entries)
            if not rows:  # the baseline, on the first journal (both hold the same entries)
                files, size = len(paths), sum(p.stat().st_size for p in paths)
                rows.append(("read + CRC32C (baseline)", _read(paths), 0))
            start_s, replayed = run(_start(data_dir))
            # MB/s are of the entries' payload bytes (the ledgers' creation records aside),
            # the same for every row.
            entry_bytes = (scanned - LEDGERS) * ENTRY_SIZE
            rows.append((f"journal scan (framing, CRC), {shape}", scan_s, scanned))
            rows.append((f"node start (replay, flush, checkpoint), {shape}", start_s, replayed))
            rates.append(f"{entry_bytes / start_s / MB:,.0f} MB/s of entries with {shape}")
        cells = [
            (name, f"{seconds:.2f}", f"{entry_bytes / seconds / MB:,.0f}",
             f"{records:,}" if records else "-", f"{records / seconds:,.0f}" if records else "-")
            for name, seconds, records in rows
        ]  # fmt: skip
        print(
            f"- journals of {entry_bytes / MB:,.1f} MB of entries; the first: {files} "
            f"file(s) of {size / MB:,.1f} MB (preallocation included, which the baseline reads)"
        )
        print("\n".join(markdown_table(("run", "seconds", "MB/s", "records", "records/s"), cells)))
        print()
        print(f"- replay at {'; '.join(rates)} (target >= 300)")
    return 0


if __name__ == "__main__":
    writer_main(sys.argv[1:])
