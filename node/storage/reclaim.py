"""What the services that give space back (node/lifecycle/gc.py, node/offload) ask of the
engine: which entry logs GC may compact, purging deleted ledgers, recording an offload,
dropping an offloaded ledger's local copy.

Each changes the index outside a checkpoint, so each runs under the checkpoint's lock or
on its flush thread (``run_serialized``): a checkpoint in flight holds a snapshot of the
metadata it took before, and must neither write it over a newer record nor have its
current entry log taken for a sealed one.
"""

from __future__ import annotations

import asyncio
import dataclasses
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from node.storage.cache import WriteCaches
from node.storage.checkpoint import Checkpointer
from node.storage.compaction import Compactor
from node.storage.descriptor import LedgerTable
from node.storage.entrylog import EntryLogReader, EntryLogWriter, list_logs
from node.storage.errors import Backpressure, InvalidArgument, LedgerNotFound
from node.storage.index import Index, LedgerMeta, LedgerState, OffloadInfo, OffloadState
from node.storage.reads import EntryReads


class Reclaim:
    """The engine's side of GC and offload; on the event loop unless said otherwise."""

    def __init__(
        self,
        table: LedgerTable,
        caches: WriteCaches,
        index: Index,
        writer: EntryLogWriter,
        reader: EntryLogReader,
        compactor: Compactor,
        checkpoints: Checkpointer,
        reads: EntryReads,
        flush_executor: ThreadPoolExecutor,
        ledgers_dir: Path,
    ) -> None:
        self._table = table
        self._caches = caches
        self._index = index
        self._writer = writer
        self._reader = reader
        self._compactor = compactor
        self._checkpoints = checkpoints
        self._reads = reads
        self._executor = flush_executor
        self._ledgers_dir = ledgers_dir

    # --- garbage collection ------------------------------------------------------------------

    def sealed_logs(self) -> list[int]:
        """Entry logs that are sealed: not the checkpoint's current log, not a compaction
        output being written, not retired; GC's candidates.

        On the flush thread only, between checkpoints: one that rolls its log has, for a
        while, no current log but a new file holding only a header (GC would delete it as
        empty, then the checkpoint would index records into the deleted file), and a
        sealed log whose records it has not indexed yet (compaction would find them dead
        and delete the log)."""
        busy = {self._writer.current_log_id, *self._compactor.in_progress, *self._reader.retired}
        return [i for i in list_logs(self._ledgers_dir) if i not in busy]

    async def purge_deleted_ledgers(self) -> list[int]:
        """Forget deleted ledgers whose deletion a checkpoint has made durable: their
        index entries and metadata go in one batch. Returns their ids.

        Under the checkpoint lock: a checkpoint in flight has taken its dirty ledgers out
        of ``dirty`` before their deletion is durable, and puts them back if it fails;
        a purge between the two would take a deletion that no checkpoint wrote for a
        durable one."""
        table = self._table
        async with self._checkpoints.lock:
            ready = [
                lid
                for lid, meta in table.metas.items()
                if meta.state == LedgerState.DELETED
                and lid not in table.dirty
                and lid not in table.deleting
                and meta.offload is None  # its objects first (node/offload clears this)
            ]
            if not ready:
                return []
            await asyncio.get_running_loop().run_in_executor(
                self._executor, self._index.delete_ledgers, ready, table.next_ledger_id
            )
            for lid in ready:
                del table.metas[lid]  # still deleted: nothing undeletes a ledger
            return ready

    # --- offload -----------------------------------------------------------------------------

    async def record_offload(self, ledger_id: int, info: OffloadInfo | None) -> LedgerMeta:
        """Make a ledger's offload record durable (the index, synchronously), then adopt
        it. Only a closed ledger gets one; None clears it (also of a deleted ledger, once
        its objects are gone, which lets GC purge the ledger)."""
        if ledger_id in self._table.dirty:
            # Its entries and LAC reach the index first: a record written now would carry a
            # LAC ahead of the locations, which an audit snapshot reads as holes. Closed, the
            # ledger cannot be dirtied again before the lock below.
            await self._checkpoints.checkpoint()
        async with self._checkpoints.lock:  # a checkpoint must not write an older snapshot
            meta = self._table.metas.get(ledger_id)
            if meta is None or (info is not None and meta.state == LedgerState.DELETED):
                raise LedgerNotFound(f"ledger {ledger_id} does not exist")
            if info is not None and meta.state != LedgerState.CLOSED:
                raise InvalidArgument(f"ledger {ledger_id} is not closed")
            if info is not None and meta.offload is not None and meta.offload.local_deleted:
                raise InvalidArgument(f"ledger {ledger_id} has no local copy left")
            updated = dataclasses.replace(meta, offload=info)
            await asyncio.get_running_loop().run_in_executor(
                self._executor, self._index.write, (), [updated]
            )
            meta.offload = info
            return meta

    async def drop_local_copy(self, ledger_id: int) -> LedgerMeta:
        """Forget where an offloaded ledger's entries are in the entry logs (GC reclaims
        them like any deleted data); reads go to the object store from now on. Refused
        unless the offload is recorded as verified."""
        meta = self._table.ledger(ledger_id)
        if meta.offload is None or meta.offload.state != OffloadState.OFFLOADED:
            raise InvalidArgument(f"ledger {ledger_id} is not offloaded")
        if meta.offload.local_deleted:
            return meta
        if self._reads.cold is None:
            raise InvalidArgument("no reader of offloaded ledgers is set")
        # Entries still cached would be indexed again by a later checkpoint: flush them.
        await self._checkpoints.checkpoint()
        async with self._checkpoints.lock:
            meta = self._table.ledger(ledger_id)
            if self._caches.highest_entry_id(ledger_id) >= 0:
                raise Backpressure(f"entries of ledger {ledger_id} are still being flushed")
            assert meta.offload is not None
            offload = dataclasses.replace(meta.offload, local_deleted=True)
            updated = dataclasses.replace(meta, offload=offload)
            await asyncio.get_running_loop().run_in_executor(
                self._executor, self._index.drop_locations, updated
            )
            meta.offload = offload
            return meta
