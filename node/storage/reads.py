"""Reads of durable entries: write cache -> cache being flushed -> read cache -> (reader
thread) index -> entry log, with read-ahead of the following entries of the same ledger
into the read cache; an offloaded ledger's entries come from the object store instead.

Only durable entries of a local ledger are read: up to the LAC, and the ids past it that are
durable (added at chosen positions). A replicated ledger's replica holds a stripe of ids
and its LAC is the writer's: an id it holds is served whatever is below it.

"Not found" means the index has no such key, nothing else: an I/O error is
``StorageIoError``, a record failing its checks ``CorruptRecord`` (a replica that answered
"absent" for an entry it could not read could get a recovery to cut the ledger short,
BookKeeper #2908). A read that races a compaction retiring its log looks the entry up
again (its new location is indexed before the old log is retired); one that races a
deletion answers ``LedgerNotFound``.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from node.settings import Settings
from node.storage.cache import ReadCache, WriteCaches
from node.storage.descriptor import LedgerTable
from node.storage.entrylog import EntryLogReader, LogRetired
from node.storage.errors import EntryNotFound, StorageClosed, StorageIoError
from node.storage.faults import Faults
from node.storage.index import MAX_ID, Index, LedgerMeta
from node.storage.lac import LacTracker
from node.storage.probe import Stats

READER_THREADS = 4  # enough to overlap a few cold reads; reads mostly hit the caches
READ_ATTEMPTS = 3  # lookups of an entry whose log compaction retires under the read


class ColdReader(Protocol):
    """Reads entries of an offloaded ledger from wherever the offload put them."""

    async def read(self, meta: LedgerMeta, entry_id: int) -> bytes: ...


class EntryReads:
    """The read path; state (the caches) on the event loop, lookups on reader threads."""

    def __init__(
        self,
        settings: Settings,
        table: LedgerTable,
        lac: LacTracker,
        caches: WriteCaches,
        read_cache: ReadCache,
        index: Index,
        reader: EntryLogReader,
        executor: ThreadPoolExecutor,
        stats: Stats,
        faults: Faults | None = None,
    ) -> None:
        self._settings = settings
        self._table = table
        self._lac = lac
        self._caches = caches
        self._read_cache = read_cache
        self._index = index
        self._reader = reader
        self._executor = executor
        self._stats = stats
        faults = faults or Faults()
        self._index_fault = faults.step("index.get")
        self._read_fault = faults.step("entrylog.read")
        self.cold: ColdReader | None = None  # reads of offloaded ledgers (node/offload)

    async def entry(self, ledger_id: int, entry_id: int) -> bytes:
        """The payload of a durable entry; EntryNotFound for anything not (yet) durable."""
        table = self._table
        meta = table.ledger(ledger_id)
        if not self._lac.is_durable(meta, entry_id) and meta.replication is None:
            raise EntryNotFound(f"entry {entry_id} of ledger {ledger_id} does not exist")
        if self._reads_cold(meta):
            assert self.cold is not None
            cold = await self.cold.read(meta, entry_id)
            table.ledger(ledger_id)  # deleted while we read
            self._stats.reads += 1
            self._stats.read_bytes += len(cold)
            return cold
        found = self._caches.get(ledger_id, entry_id)
        if found is None:
            found = self._read_cache.get(ledger_id, entry_id)
        if found is None:
            found = await self.stored(ledger_id, entry_id)
            meta = table.ledger(ledger_id)  # deleted while we read
            if found is None and self._reads_cold(meta):
                assert self.cold is not None  # its local copy went while we read
                found = await self.cold.read(meta, entry_id)
            if found is None:
                raise EntryNotFound(f"entry {entry_id} of ledger {ledger_id} is not indexed")
        self._stats.reads += 1
        self._stats.read_bytes += len(found)
        return found

    async def range(
        self, ledger_id: int, first: int, last: int | None = None
    ) -> AsyncIterator[tuple[int, bytes]]:
        """Durable entries with ids in [first, last] (last defaults to the highest durable
        id), in order, as of the call: up to the LAC every id, past it the ids added at
        chosen positions. Only ids that exist are visited, so an entry added at id 2^62 costs
        one read, not a walk over the hole; the loop gets a turn every chunk."""
        meta = self._table.ledger(ledger_id)
        start = max(first, 0)
        if meta.replication is not None:
            async for found in self._replica_range(ledger_id, start, last):
                yield found
            return
        above = sorted(e for e in self._lac.durable_above(ledger_id) if e >= start)
        if last is not None:
            above = above[: bisect.bisect_right(above, last)]
        lac_part = range(start, (meta.lac if last is None else min(last, meta.lac)) + 1)
        chunk = self._settings.range_read_chunk_entries
        for done, entry_id in enumerate(itertools.chain(lac_part, above), 1):
            yield entry_id, await self.entry(ledger_id, entry_id)
            if done % chunk == 0:
                await asyncio.sleep(0)  # cached entries never suspend: let others run

    async def _replica_range(
        self, ledger_id: int, first: int, last: int | None
    ) -> AsyncIterator[tuple[int, bytes]]:
        """The ids of a replicated ledger this node holds in [first, last]: indexed or in a
        write cache, ascending."""
        top = MAX_ID if last is None else last
        indexed = await asyncio.get_running_loop().run_in_executor(
            self._executor, lambda: list(self._index.entry_ids(ledger_id, first, top))
        )
        caches = self._caches
        cached = caches.current.entry_ids(ledger_id)
        if caches.flushing is not None:
            cached += caches.flushing.entry_ids(ledger_id)
        ids = sorted({*indexed, *(e for e in cached if first <= e <= top)})
        chunk = self._settings.range_read_chunk_entries
        for done, entry_id in enumerate(ids, 1):
            yield entry_id, await self.entry(ledger_id, entry_id)
            if done % chunk == 0:
                await asyncio.sleep(0)

    async def held_runs(self, ledger_id: int, first: int, last: int) -> list[tuple[int, int]]:
        """The ids of the ledger this node holds in [first, last] as merged ranges (first,
        last), ascending: indexed or in a write cache. No payload is read: the index's keys
        and the caches' ids only. LedgerNotFound for a ledger it does not know."""
        self._table.ledger(ledger_id)
        caches = self._caches
        cached = caches.current.entry_ids(ledger_id)
        if caches.flushing is not None:
            cached += caches.flushing.entry_ids(ledger_id)
        indexed = await asyncio.get_running_loop().run_in_executor(
            self._executor, self._index.held_runs, ledger_id, first, last
        )
        return merge_runs(indexed, [(e, e) for e in cached if first <= e <= last])

    def _reads_cold(self, meta: LedgerMeta) -> bool:
        offload = meta.offload
        if offload is None or not offload.offloaded:
            return False
        if offload.local_deleted:
            if self.cold is None:
                raise StorageClosed(f"ledger {meta.ledger_id} is offloaded; no reader is set")
            return True
        tiered_first = self._settings.managed_ledger_data_read_priority == "tiered-storage-first"
        return tiered_first and self.cold is not None

    async def stored(self, ledger_id: int, entry_id: int) -> bytes | None:
        """Index -> entry log on a reader thread; read-ahead fills the read cache."""
        run = await asyncio.get_running_loop().run_in_executor(
            self._executor, self._read_run, ledger_id, entry_id
        )
        if not run:
            return None
        for eid, payload in run:
            self._read_cache.put(ledger_id, eid, payload)
        return run[0][1]

    def _read_run(self, ledger_id: int, entry_id: int) -> list[tuple[int, bytes]]:
        cache = self._read_cache
        settings = self._settings
        for _attempt in range(READ_ATTEMPTS):
            try:
                self._index_fault()
                loc = self._index.get_location(ledger_id, entry_id)
            except OSError as e:
                raise StorageIoError(
                    f"index lookup of entry {entry_id} of ledger {ledger_id} failed: {e}"
                ) from e
            if loc is None:
                return []
            try:
                self._read_fault()
                return self._reader.read_run(
                    loc,
                    ledger_id,
                    entry_id,
                    settings.db_storage_read_ahead_cache_batch_size,
                    settings.db_storage_read_ahead_cache_batch_bytes_size,
                    lambda lid, eid: (lid, eid) in cache,
                )
            except LogRetired:
                continue  # compacted meanwhile: the index has its new location
            except OSError as e:
                raise StorageIoError(
                    f"reading entry {entry_id} of ledger {ledger_id} failed: {e}"
                ) from e
        raise StorageClosed(f"entry {entry_id} of ledger {ledger_id} kept moving; retry")


def merge_runs(*parts: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Ranges (first, last) of ids from several sources as one ascending list, ranges that
    overlap or touch merged."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(itertools.chain(*parts)):
        if merged and merged[-1][1] + 1 >= start:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged
