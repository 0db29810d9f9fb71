"""``python -m node bench replay``: how fast a node comes back after a crash with a long
journal to replay, against reading the same journal bytes and checking their CRCs.

A child process adds ``--replay-mib`` MiB of 1 KiB entries (16 ledgers, batches of 100) with
checkpoints held off, then dies without closing (``os._exit``: what SIGKILL leaves, every
acknowledged record in the journal and nothing in the entry logs). Then, in this process:
- the node's start with default settings: open the index, replay the journal from the last
  mark (flushing to entry logs as the write cache fills), and the checkpoint after replay;
- the journal scan alone (``Journal.recover``: read, frame, CRC check, no state);
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
from node.storage.faults import CrashPoints
from node.storage.journal import Journal, list_journals
from node.storage.ledgers import LedgerStorage

LEDGERS = 16
READ_CHUNK = 1 * MiB  # the baseline's read and CRC unit
HELD_OFF_MS = 3_600_000  # the writer's checkpoint period: none happens while it writes


def _writer_settings(data_dir: Path, mib: int) -> Settings:
    # A write cache that holds it all, so that no checkpoint moves the mark.
    cache = max(64 * MiB, 4 * mib * MiB)
    return load(
        data_dir=data_dir, flush_interval=HELD_OFF_MS, db_storage_write_cache_max_size=cache
    )


async def _write(data_dir: Path, mib: int) -> None:
    storage = LedgerStorage(_writer_settings(data_dir, mib))
    await storage.start()
    ledgers = [(await storage.create_ledger())[0].ledger_id for _ in range(LEDGERS)]
    batch = [os.urandom(ENTRY_SIZE)] * BATCH_ENTRIES
    batches = mib * MiB // (ENTRY_SIZE * BATCH_ENTRIES)

    async def writer(ledger_id: int, count: int) -> None:
        for _ in range(count):
            await storage.add_entries(ledger_id, batch)

    share = [batches // LEDGERS + (n < batches % LEDGERS) for n in range(LEDGERS)]
    await asyncio.gather(*(writer(lid, n) for lid, n in zip(ledgers, share, strict=True)))
    os._exit(0)  # a crash: no final checkpoint, the journal holds everything acknowledged


def writer_main(argv: list[str]) -> None:
    data_dir, mib = argv
    run(_write(Path(data_dir), int(mib)))


async def _start(data_dir: Path) -> tuple[float, int]:
    storage = LedgerStorage(load(data_dir=data_dir))
    started = time.perf_counter()
    await storage.start()
    elapsed = time.perf_counter() - started
    records = storage.stats.replayed_records
    await storage.close()
    return elapsed, records


def _scan(settings: Settings) -> tuple[float, int]:
    journal = Journal(settings, SystemClock(), CrashPoints(frozenset()))
    started = time.perf_counter()
    records = sum(1 for _ in journal.recover(journal.last_mark()))
    return time.perf_counter() - started, records


def _read(paths: list[Path]) -> float:
    started = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(READ_CHUNK):
                crc32c.crc32c(chunk)
    return time.perf_counter() - started


def main(args: argparse.Namespace) -> int:
    mib = args.replay_mib
    require_positive(replay_mib=mib)
    with scratch_dir(args.dir, "node-bench-replay-") as scratch:
        data_dir = scratch / "data"
        print(f"## node bench replay: {mib} MiB of {ENTRY_SIZE} B entries in the journal")
        subprocess.run([sys.executable, "-m", __name__, str(data_dir), str(mib)], check=True)
        settings = load(data_dir=data_dir)
        paths = [settings.journal_dir / f"{i:x}.txn" for i in list_journals(settings.journal_dir)]
        if not paths:
            raise UsageError("the writer left no journal")
        tune()
        read_s = _read(paths)
        scan_s, scanned = _scan(settings)
        # MB/s are of the entries' payload bytes, the same for every row.
        entry_bytes = scanned * ENTRY_SIZE
        start_s, replayed = run(_start(data_dir))
        rows = [
            ("read + CRC32C (baseline)", read_s, 0),
            ("journal scan (framing, CRC)", scan_s, scanned),
            ("node start (replay, flush, checkpoint)", start_s, replayed),
        ]
        cells = [
            (name, f"{seconds:.2f}", f"{entry_bytes / seconds / MB:,.0f}",
             f"{records:,}" if records else "-", f"{records / seconds:,.0f}" if records else "-")
            for name, seconds, records in rows
        ]  # fmt: skip
        size = sum(p.stat().st_size for p in paths)
        print(
            f"- journal: {len(paths)} file(s) of {size / MB:,.1f} MB (preallocation included, "
            f"which the baseline reads too), {entry_bytes / MB:,.1f} MB of entries"
        )
        print("\n".join(markdown_table(("run", "seconds", "MB/s", "records", "records/s"), cells)))
        print()
        print(
            f"- node start / baseline: {read_s / start_s:.2f}x; "
            f"replay at {entry_bytes / start_s / MB:,.0f} MB/s of entries (target >= 300)"
        )
    return 0


if __name__ == "__main__":
    writer_main(sys.argv[1:])
