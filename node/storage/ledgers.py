"""Ledger storage: the engine's one public API (BookKeeper's Bookie + DbLedgerStorage).

This façade starts and stops the engine and wires its parts together; each part lives in
a module of its own (in node/storage/), given its collaborators explicitly:

- ``descriptor``: the ledger table (metadata by id, dirty set, ids) and the checks an add
  passes (write token, open ledger, ids left);
- ``adds``: the add path: write cache + WAL append in one step, acknowledged at the fsync;
- ``settle``: appends the WAL refused or their caller abandoned;
- ``transitions``: create, fence, close, delete, explicit LAC, each journaled;
- ``lac``: the LAC over entries durable out of order, and its long polls;
- ``reads``: write cache -> read cache -> index -> entry log (or the object store);
- ``checkpoint``: write cache -> entry logs and index, then the WAL trimmed; back-pressure;
- ``replay``: the ledger table and the WAL since the last checkpoint, put back at start;
- ``readonly``: whether adds are taken: running, and why read-only (operator, disk);
- ``reclaim``: what GC and offload ask (sealed logs, purge, offload record, local copy).

State lives on the event loop thread; blocking work runs on two executors: one flush
thread (checkpoints are serial, and so is every other write of the index) and a small pool
of reader threads. The parts that need the index are built by ``start``, once it is open.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from node.settings import Settings
from node.storage.adds import AddPath, PendingAdd, ReplicaAdd
from node.storage.blockwal import BlockWal
from node.storage.cache import ReadCache, WriteCaches
from node.storage.checkpoint import Checkpointer
from node.storage.clock import Clock, SystemClock
from node.storage.compaction import Compactor
from node.storage.descriptor import LedgerTable
from node.storage.entrylog import EntryLogReader, EntryLogWriter, LogIdAllocator
from node.storage.faults import Faults
from node.storage.fsutil import is_no_space
from node.storage.index import Index, LedgerMeta, OffloadInfo
from node.storage.journal import Journal
from node.storage.lac import LacTracker
from node.storage.probe import NullProbe, Stats, StorageProbe
from node.storage.readonly import ReadOnlySource, ReadOnlyState
from node.storage.reads import READER_THREADS, ColdReader, EntryReads
from node.storage.reclaim import Reclaim
from node.storage.replay import Replayer
from node.storage.transitions import DeletionListener, LedgerTransitions
from node.storage.wal import LogMark, Wal

log = logging.getLogger(__name__)
T = TypeVar("T")


class LedgerStorage:
    def __init__(
        self,
        settings: Settings,
        clock: Clock | None = None,
        wal: Wal | None = None,
        probe: StorageProbe | None = None,
        instance_id: Callable[[], bytes] | None = None,
    ) -> None:
        self.settings = settings
        # What the WAL's new headers carry, read when it starts (the node's cookie's instance)
        self._instance_id = instance_id
        self._clock = clock or SystemClock()
        self._crash = Faults.from_settings(settings)
        self._probe: StorageProbe = probe or NullProbe()
        self._wal: Wal = wal or self._open_wal()
        self._log_ids = LogIdAllocator(settings.ledgers_dir)
        self._writer = EntryLogWriter(settings, self._log_ids)
        self._reader = EntryLogReader(settings, self._clock.monotonic)
        self._table = LedgerTable()
        self._lac = LacTracker(self._table)
        self._caches = WriteCaches()
        self._transitions = LedgerTransitions(self._wal, self._table, self._lac, self._clock)
        self._read_only = ReadOnlyState()
        self._read_cache = ReadCache(
            settings.db_storage_read_ahead_cache_max_size, settings.db_storage_read_cache_segments
        )
        self._half_cache = settings.db_storage_write_cache_max_size // 2  # asks for a checkpoint
        self._flush_executor = ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
        self._read_executor = ThreadPoolExecutor(READER_THREADS, thread_name_prefix="reader")
        self.stats = Stats()
        # Built by start(), once the index is open.
        self._index: Index | None = None
        self._compactor: Compactor | None = None
        self._checkpoints: Checkpointer
        self._reads: EntryReads
        self._reclaim: Reclaim
        self._adds: AddPath

    # --- start and stop ------------------------------------------------------------------

    async def start(self) -> None:
        """Open the index, load ledger metadata, replay the WAL from the last mark, then
        checkpoint so that the replayed entries are in entry logs before serving."""
        loop = asyncio.get_running_loop()
        settings, executor = self.settings, self._flush_executor
        index = self._index = await loop.run_in_executor(executor, Index, settings.index_dir)
        self._compactor = Compactor(
            settings, index, self._reader, self._log_ids, self.run_serialized, self._crash
        )
        self._checkpoints = Checkpointer(
            settings, self._clock, self._wal, index, self._writer, self._caches, self._table,
            self.stats, self._probe, self._crash, executor, self._half_cache, self._no_space,
        )  # fmt: skip
        self._reads = EntryReads(
            settings, self._table, self._lac, self._caches, self._read_cache, index,
            self._reader, self._read_executor, self.stats, self._crash,
        )  # fmt: skip
        self._reclaim = Reclaim(
            self._table, self._caches, index, self._writer, self._reader, self._compactor,
            self._checkpoints, self._reads, executor, settings.ledgers_dir,
        )  # fmt: skip
        replay = Replayer(
            self._wal, index, self._table, self._caches, self._lac, self._checkpoints,
            self.stats, self._clock, self._half_cache,
        )  # fmt: skip
        self._adds = AddPath(
            self._table, self._caches, self._lac, self._wal, self._read_only, self._checkpoints,
            self._reads, self.stats, settings.max_entry_size, self._half_cache,
            self._transitions,
        )  # fmt: skip
        self._checkpoints.last_mark = await loop.run_in_executor(executor, replay.run)
        await self._wal.start()
        self._read_only.set_running(True)
        try:
            await self.checkpoint()
        except Exception as e:
            # A full disk must not keep the node down: it serves reads, read-only, with
            # the replayed entries in the write cache, and the checkpointer retries.
            if not is_no_space(e):
                raise
            self._no_space(f"no space left for a checkpoint: {e}")
            log.error("the checkpoint after replay failed for want of space (%s)", e)
        self._checkpoints.start()

    async def close(self) -> None:
        """Graceful stop: a final checkpoint, roll the entry log so it carries its map,
        close the WAL. The next start replays nothing."""
        if not self._read_only.running:
            return
        self._read_only.set_running(False)
        await self._checkpoints.stop()
        try:
            await self.checkpoint(force=True)
        except Exception as e:
            # Nothing is lost: the WAL holds everything since the last mark, and the next
            # start replays it. Stopping goes on, so the WAL and files close cleanly.
            log.error("the final checkpoint failed (%s); the next start replays the WAL", e)
        await self._wal.close()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._flush_executor, self._close_files)
        self._lac.closed()
        self._flush_executor.shutdown(wait=False)  # idle: last job awaited
        self._read_executor.shutdown(wait=False)

    def _close_files(self) -> None:
        try:
            self._writer.roll()
        except OSError as e:
            # The map is an optimisation: a log without one is scanned when GC needs it.
            # Cut off what the failed write left, so the log ends with whole records.
            log.warning("could not write the ledgers map of the current entry log: %s", e)
            self._writer.discard_unflushed()
        self._writer.close()
        self._reader.close()
        if self._index is not None:
            self._index.close()

    def _open_wal(self) -> Wal:
        if self.settings.wal_kind == "blockdev":
            return BlockWal(
                self.settings,
                self._clock,
                self._crash,
                self._probe,
                self._wal_wants_checkpoint,
                instance_id=self._instance_id,
            )
        return Journal(
            self.settings,
            self._clock,
            self._crash,
            self._probe,
            on_no_space=self._no_space,
            instance_id=self._instance_id,
        )

    def _no_space(self, reason: str) -> None:
        """A write found the disk full: refuse adds at once (507) rather than fail them one
        write at a time. The disk monitor lifts it once usage is under the low watermark."""
        self.set_read_only(reason, ReadOnlySource.DISK)

    def _wal_wants_checkpoint(self) -> None:
        """The ring is filling up: a checkpoint lets it trim (appends, so after start)."""
        self._checkpoints.want(force=True)

    # --- ledgers (node.storage.transitions) --------------------------------------------------

    async def create_ledger(
        self,
        ledger_id: int | None = None,
        properties: dict[str, str] | None = None,
        write_token: str | None = None,
    ) -> tuple[LedgerMeta, bool]:
        """Create a ledger (node-allocated id when None). Returns (metadata, created):
        creating an existing open ledger with the same id again is a no-op."""
        self._read_only.check()
        return await self._transitions.create(ledger_id, properties, write_token)

    def ledger(self, ledger_id: int) -> LedgerMeta:
        return self._table.ledger(ledger_id)

    def ledgers(self) -> Iterable[LedgerMeta]:
        return self._table.ledgers()

    def all_ledgers(self) -> Iterable[LedgerMeta]:
        """Every ledger the node knows, deleted ones (tombstones until GC) included."""
        return self._table.metas.values()

    async def fence(self, ledger_id: int, write_token: str | None = None) -> int:
        """No add succeeds after this returns; returns the LAC (BookKeeper's fence read)."""
        return await self._transitions.fence(ledger_id, write_token)

    async def close_ledger(self, ledger_id: int, write_token: str | None = None) -> LedgerMeta:
        """Seal the ledger: its last entry is fixed (adds in flight finish first)."""
        return await self._transitions.close(ledger_id, write_token)

    async def delete_ledger(self, ledger_id: int, write_token: str | None = None) -> None:
        """Entries become unreadable at once; GC reclaims their space later."""
        await self._transitions.delete(ledger_id, write_token)

    async def set_explicit_lac(self, ledger_id: int, lac: int) -> int:
        """Raise the LAC to ``lac`` (never lowers it); entries up to it must be durable."""
        return await self._transitions.set_explicit_lac(ledger_id, lac)

    # --- adds (node.storage.adds) -----------------------------------------------------------
    # Plain functions handing back the add path's coroutine or result: no frame of their own
    # on the hot path.

    def add_entry(
        self,
        ledger_id: int,
        entry_id: int | None,
        payload: bytes,
        write_token: str | None = None,
    ) -> Coroutine[Any, Any, int]:
        """Add one entry (at the next id when ``entry_id`` is None); returns its id once it
        is durable. Adding identical bytes again is a no-op; different bytes conflict."""
        return self._adds.add_entry(ledger_id, entry_id, payload, write_token)

    def add_entries(
        self, ledger_id: int, payloads: list[bytes], write_token: str | None = None
    ) -> Coroutine[Any, Any, list[int]]:
        """Append a batch at the next ids; one durable acknowledgment for all of them."""
        return self._adds.add_entries(ledger_id, payloads, write_token)

    def begin_add(
        self, ledger_id: int, payload: bytes, write_token: str | None = None
    ) -> PendingAdd | None:
        """``add_entry`` at the next id without a coroutine, for the HTTP fast lane: the add
        as far as it goes without waiting, or None (then ``add_entry`` does it)."""
        return self._adds.begin_add(ledger_id, payload, write_token)

    def finish_add(self, add: PendingAdd) -> int:
        """The entry id of a ``begin_add`` whose future is done, or its error."""
        return self._adds.finish_add(add)

    # --- replicated ledgers (node.storage.adds, node.storage.transitions) ---------------------

    def add_replica(
        self, ledger_id: int, entries: list[tuple[int, bytes]], replica: ReplicaAdd
    ) -> Coroutine[Any, Any, LedgerMeta]:
        """Entries at the writer's ids (ascending) of a replicated ledger, created here on
        its first add; its metadata once they are durable (see ``AddPath.add_replica``)."""
        return self._adds.add_replica(ledger_id, entries, replica)

    def begin_replica_add(
        self, ledger_id: int, entry_id: int, payload: bytes, replica: ReplicaAdd
    ) -> PendingAdd | None:
        """``begin_add`` of one replica entry at a fresh id, or None (``add_replica``)."""
        return self._adds.begin_replica_add(ledger_id, entry_id, payload, replica)

    def finish_replica_add(self, add: PendingAdd) -> int:
        return self._adds.finish_replica_add(add)

    async def fence_replica(
        self, ledger_id: int, replication: tuple[int, int, int] | None = None
    ) -> LedgerMeta:
        """A fencing read's fence, durable when this returns; an unknown ledger is created
        FENCED (``replication`` when the reader told it, else quorums unknown)."""
        return await self._transitions.fence_replica(ledger_id, replication)

    async def fencing_read(
        self, ledger_id: int, entry_id: int, replication: tuple[int, int, int] | None = None
    ) -> bytes:
        """A recovery's read: the fence, durable, *then* the lookup. An add appended before
        the fence is durable once the fence is, so the read finds it; none is taken after
        it; so no add is acknowledged here that this read called absent (BookKeeper #2614)."""
        await self._transitions.fence_replica(ledger_id, replication)
        return await self._reads.entry(ledger_id, entry_id)

    def replicated_ledgers(self) -> list[tuple[int, int]]:
        """(ledger id, created ms) of every replicated ledger the node holds, not deleted
        (the identity side's GC asks the metadata store about each)."""
        return [(m.ledger_id, m.created_ms) for m in self._table.ledgers() if m.replication]

    def replica_adds(self, ledger_id: int) -> int:
        """Replica adds the ledger took since start (resends included); LedgerNotFound."""
        return self._table.ledger(ledger_id).replica_adds

    async def delete_quiet_replica(self, ledger_id: int, replica_adds: int) -> bool:
        """Delete the replicated ledger only if it took no replica add since ``replica_adds``
        was read; False (kept) otherwise. The test and the deletion's first, synchronous step
        (the ledger unreadable, no add taken) run with no await between them, so an add is
        either counted before it or refused after it."""
        meta = self._table.ledger(ledger_id)
        if meta.replica_adds != replica_adds:
            return False
        await self._transitions.delete(ledger_id, None)
        return True

    # --- state -----------------------------------------------------------------------------

    def set_read_only(
        self, reason: str | None, source: ReadOnlySource = ReadOnlySource.OPERATOR
    ) -> None:
        """Refuse adds and new ledgers for ``reason``, or (None) lift what ``source`` set
        (see node.storage.readonly)."""
        self._read_only.set(reason, source)

    def read_only_source(self, source: ReadOnlySource) -> bool:
        return self._read_only.holds(source)

    @property
    def read_only_reason(self) -> str | None:
        return self._read_only.reason

    @property
    def running(self) -> bool:
        return self._read_only.running

    @property
    def wal_failure(self) -> str | None:
        """Why the WAL failed for good (adds answer 500 ``journal_failed`` until a restart)."""
        return self._wal.failure

    @property
    def refuses_adds(self) -> bool:
        """Read-only (an operator, a full disk), or a WAL that failed for good."""
        return self._read_only.held or self._wal.failure is not None

    # --- LAC (node.storage.lac) --------------------------------------------------------------

    async def wait_lac(self, ledger_id: int, after: int, timeout_s: float) -> int:
        """Long-poll: the LAC once it passes ``after``, or the current LAC at the timeout
        or as soon as the ledger is fenced or closed (no add moves it any more)."""
        return await self._lac.wait(ledger_id, after, timeout_s)

    def release_waiters(self) -> None:
        """Answer every long poll now with the current LAC (at shutdown)."""
        self._lac.release()

    @property
    def lac_waiters(self) -> int:
        """Long polls waiting for a LAC to pass."""
        return self._lac.waiting

    # --- reads (node.storage.reads) ----------------------------------------------------------

    async def read_entry(self, ledger_id: int, entry_id: int) -> bytes:
        """The payload of a durable entry; EntryNotFound for anything not (yet) durable."""
        return await self._reads.entry(ledger_id, entry_id)

    def read_range(
        self, ledger_id: int, first: int, last: int | None = None
    ) -> AsyncIterator[tuple[int, bytes]]:
        """Durable entries with ids in [first, last] (last defaults to the highest durable
        id), in order, as of the call (see ``EntryReads.range``)."""
        return self._reads.range(ledger_id, first, last)

    async def held_runs(self, ledger_id: int, first: int, last: int) -> list[tuple[int, int]]:
        """The ids of the ledger held here in [first, last], as merged ranges (first, last)
        read from the index and the write caches, no payload (see ``EntryReads.held_runs``)."""
        return await self._reads.held_runs(ledger_id, first, last)

    # --- checkpoint (node.storage.checkpoint) ------------------------------------------------

    async def checkpoint(self, force: bool = False) -> None:
        await self._checkpoints.checkpoint(force)

    @property
    def last_checkpoint_mark(self) -> LogMark:
        return self._checkpoints.last_mark

    # --- garbage collection (driven by node.lifecycle.gc; node.storage.reclaim) --------------

    @property
    def compactor(self) -> Compactor:
        assert self._compactor is not None, "the storage is not started"
        return self._compactor

    def gc_candidate_logs(self) -> list[int]:
        """Blocking, from a worker thread: the sealed entry logs, taken between checkpoints."""
        return self.run_serialized(self._reclaim.sealed_logs)

    def is_live_ledger(self, ledger_id: int) -> bool:
        """See ``LedgerTable.is_live``; thread safe."""
        return self._table.is_live(ledger_id)

    async def purge_deleted_ledgers(self) -> list[int]:
        return await self._reclaim.purge_deleted_ledgers()

    def retire_log(self, log_id: int) -> bool:
        """Delete a log once no read holds it; True if it is gone already."""
        return self._reader.retire(log_id)

    def reap_retired_logs(self) -> list[int]:
        return self._reader.reap(self.settings.destroy_mapped_file_interval_forcibly_ms / 1000)

    @property
    def retired_logs(self) -> list[int]:
        return self._reader.retired

    def run_serialized(self, work: Callable[[], T]) -> T:
        """Blocking, from a worker thread: run ``work`` between checkpoints."""
        return self._flush_executor.submit(work).result()

    # --- tiered storage (driven by node.offload; node.storage.reclaim) -----------------------

    def set_cold_reader(self, reader: ColdReader | None) -> None:
        self._reads.cold = reader

    def add_deletion_listener(self, listener: DeletionListener) -> None:
        """``listener(meta)`` runs after each ledger deletion is in the WAL."""
        self._transitions.deletion_listeners.append(listener)

    async def record_offload(self, ledger_id: int, info: OffloadInfo | None) -> LedgerMeta:
        return await self._reclaim.record_offload(ledger_id, info)

    async def drop_local_copy(self, ledger_id: int) -> LedgerMeta:
        return await self._reclaim.drop_local_copy(ledger_id)

    # --- records of the layers above (streams) ---------------------------------------------

    async def write_records(self, changes: dict[bytes, bytes | None]) -> None:
        """Durable, atomic puts and deletes in the streams keyspace."""
        self._read_only.check_running()
        await asyncio.get_running_loop().run_in_executor(
            self._read_executor, self.index.write_records, changes
        )

    async def load_records(self) -> dict[bytes, bytes]:
        return await asyncio.get_running_loop().run_in_executor(
            self._read_executor, self.index.records
        )

    # --- introspection ---------------------------------------------------------------------

    @property
    def write_cache_bytes(self) -> int:
        return self._caches.size

    @property
    def wal_queued_bytes(self) -> int:
        """Bytes waiting for the next WAL write (0 for a WAL that does not say)."""
        return int(getattr(self._wal, "queued_bytes", 0))

    def index_keys_estimate(self) -> int:
        return self.index.estimated_keys()

    @property
    def read_cache(self) -> ReadCache:
        return self._read_cache

    @property
    def index(self) -> Index:
        assert self._index is not None
        return self._index
