"""A small world for GC tests: ledgers interleaved across many small entry logs, and
checks that every surviving entry reads back and that no index entry dangles."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from node.settings import Settings, load
from node.storage import entrylog, logformat
from node.storage.ledgers import LedgerStorage
from tests.harness.hostdisk import HOST_DISK_NEUTRAL

LOG_SIZE = 64 * 1024
ENTRY_SIZE = 1000
ENTRIES_PER_ROUND = 4


def gc_settings(data_dir: Path, **overrides: Any) -> Settings:
    base: dict[str, Any] = {
        **HOST_DISK_NEUTRAL,
        "data_dir": data_dir,
        "log_size_limit": LOG_SIZE,
        "max_entry_size": 16 * 1024,
        "journal_pre_alloc_size": 1 << 20,
        "db_storage_write_cache_max_size": 8 << 20,
        "flush_interval_ms": 3_600_000,
        "gc_wait_time_ms": 3_600_000,
        "compaction_rate_by_entries": 1_000_000,  # unthrottled unless a test says otherwise
        # Off, so that tests of the intervals and thresholds see only those; the space
        # trigger has tests of its own.
        "compaction_space_amplification_limit": 0,
    }
    base.update(overrides)
    return load(**base)


def payload(ledger: int, entry: int) -> bytes:
    return f"{ledger}:{entry}:".encode().ljust(ENTRY_SIZE, bytes([ledger % 251]))


async def interleave(storage: LedgerStorage, ledgers: int, rounds: int) -> list[int]:
    """``ledgers`` ledgers written round-robin, a checkpoint per round: every log holds a
    slice of each."""
    ids = [(await storage.create_ledger())[0].ledger_id for _ in range(ledgers)]
    for _ in range(rounds):
        for lid in ids:
            first = storage.ledger(lid).last_entry_id + 1
            await storage.add_entries(
                lid, [payload(lid, first + i) for i in range(ENTRIES_PER_ROUND)]
            )
        await storage.checkpoint()
    return ids


def log_bytes(ledgers_dir: Path) -> int:
    return sum(
        logformat.log_path(ledgers_dir, i).stat().st_size for i in entrylog.list_logs(ledgers_dir)
    )


async def check_survivors(storage: LedgerStorage, ledgers: list[int]) -> None:
    for lid in ledgers:
        meta = storage.ledger(lid)
        got = [(e, p) async for e, p in storage.read_range(lid, 0)]
        assert [e for e, _ in got] == list(range(meta.last_entry_id + 1))
        for entry, data in got:
            assert data == payload(lid, entry), f"({lid}, {entry}) reads back wrong"


def dangling(storage: LedgerStorage) -> list[tuple[int, int, int]]:
    """Index entries of known ledgers that do not point at their own intact record."""
    bad = []
    cache: dict[int, dict[int, tuple[int, int, bool]]] = {}
    directory = storage.settings.ledgers_dir
    for lid, eid, loc in storage.index.locations():
        if not storage.is_live_ledger(lid):
            continue
        log_id, offset = logformat.split_location(loc)
        if log_id not in cache:
            path = logformat.log_path(directory, log_id)
            cache[log_id] = (
                {r.offset: (r.ledger_id, r.entry_id, r.crc_ok) for r in entrylog.scan(path)}
                if path.exists()
                else {}
            )
        if cache[log_id].get(offset) != (lid, eid, True):
            bad.append((lid, eid, loc))
    return bad


async def dangling_entries(storage: LedgerStorage) -> list[tuple[int, int, int]]:
    return await asyncio.to_thread(dangling, storage)


def cut_ledgers_map(path: Path) -> dict[int, int]:
    """Cut a sealed log's ledgers map off, as if the node died before the roll; returns the
    map cut off."""
    sealed_with = entrylog.read_ledgers_map(path)
    assert sealed_with is not None, f"{path} was sealed without a map"
    with open(path, "r+b") as f:
        header = f.read(logformat.HEADER_SIZE)
        offset, _count = logformat.MAP_FIELDS.unpack_from(header, logformat.MAP_FIELDS_OFFSET)
        f.truncate(offset)
        f.seek(logformat.MAP_FIELDS_OFFSET)
        f.write(logformat.MAP_FIELDS.pack(0, 0))
    assert entrylog.read_ledgers_map(path) is None
    return sealed_with
