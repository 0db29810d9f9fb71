"""Ledger storage: the engine's one public API (BookKeeper's Bookie + DbLedgerStorage).

Add: validate -> write cache -> WAL append -> await the group fsync -> advance the LAC.
The cache put and the WAL append happen in one synchronous step on the event loop, so a
checkpoint's swap (also synchronous) never splits them.

Checkpoint (every ``flush_interval_ms`` and when the write cache is half full):
swap the cache and seal the WAL group (one step) -> wait for that group's fsync -> on the
flush thread: write the frozen cache sorted by (ledger, entry) to the entry log, fsync it,
write locations and changed ledger metadata in one RocksDB batch, persist ``lastMark`` and
trim the WAL -> drop the frozen cache.

Read: write cache -> cache being flushed -> read cache -> (reader thread) index -> entry
log, with read-ahead of the following entries of the same ledger into the read cache.

State lives on the event loop thread; blocking work runs on two executors: one flush
thread (checkpoints are serial) and a small pool of reader threads.
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import hashlib
import hmac
import itertools
import logging
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol, TypeVar

from node.settings import Settings
from node.storage.blockwal import BlockWal
from node.storage.cache import ReadCache, WriteCache
from node.storage.clock import Clock, SystemClock
from node.storage.compaction import Compactor
from node.storage.entrylog import (
    EntryLogReader,
    EntryLogWriter,
    LedgerEntries,
    LogIdAllocator,
    LogRetired,
    list_logs,
)
from node.storage.errors import (
    Backpressure,
    DiskFull,
    EntryConflict,
    EntryNotFound,
    EntryTooLarge,
    InvalidArgument,
    LedgerClosed,
    LedgerExists,
    LedgerFenced,
    LedgerFull,
    LedgerNotFound,
    NodeReadOnly,
    StorageClosed,
    WriteTokenMismatch,
)
from node.storage.faults import Faults
from node.storage.fsutil import is_no_space
from node.storage.index import MAX_ID, Index, LedgerMeta, LedgerState, OffloadInfo, OffloadState
from node.storage.journal import Journal
from node.storage.probe import NullProbe, StorageProbe
from node.storage.wal import (
    CLOSE,
    DELETE,
    EXPLICIT_LAC,
    FENCE,
    LEDGER_CREATED,
    EntryRun,
    LogMark,
    Wal,
    WalRecord,
    record_crc,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

I64 = struct.Struct(">q")
READER_THREADS = 4  # enough to overlap a few cold reads; reads mostly hit the caches
OPERATOR = "operator"  # sources of read-only mode
DISK = "disk"
READ_ATTEMPTS = 3  # lookups of an entry whose log compaction retires under the read
# Replay flushes as it goes in chunks of this fraction of half the write cache: small enough
# that the last chunk, flushed while nothing else runs, is short.
REPLAY_FLUSH_CHUNKS = 4
# No add moves the LAC of a ledger in these states: a long poll on one returns at once.
_SEALED = frozenset({LedgerState.FENCED, LedgerState.CLOSED})
_OPEN = LedgerState.OPEN  # tested per add: a module name is cheaper than an enum attribute


class ColdReader(Protocol):
    """Reads entries of an offloaded ledger from wherever the offload put them."""

    async def read(self, meta: LedgerMeta, entry_id: int) -> bytes: ...


DeletionListener = Callable[[LedgerMeta], Awaitable[None]]


@dataclass(slots=True)
class Stats:
    """Counters of the engine, read by metrics and benchmarks."""

    adds: int = 0
    add_bytes: int = 0
    reads: int = 0
    read_bytes: int = 0
    throttled_adds: int = 0
    rejected_adds: int = 0
    checkpoints: int = 0
    last_checkpoint_ms: int = 0  # wall clock of the last checkpoint's end; 0: none since start
    # The flush thread's work (entry log, fsync, index) of the checkpoints done: its rate is
    # what BookKeeper quotes for its single flush thread (~250K 1 KB entries/s, PR 1289).
    flushed_entries: int = 0
    flush_seconds_total: float = 0.0
    replayed_records: int = 0


@dataclass(slots=True)
class _ReplayChunk:
    """A chunk of the write cache that replay handed to its flush thread."""

    frozen: WriteCache
    metas: list[LedgerMeta]
    future: Future[None]


@dataclass(slots=True)
class PendingAdd:
    """An add that ``begin_add`` queued, until its WAL write is done (``future``)."""

    meta: LedgerMeta
    entry_id: int
    payload: bytes
    future: asyncio.Future[LogMark]


class LedgerStorage:
    def __init__(
        self,
        settings: Settings,
        clock: Clock | None = None,
        wal: Wal | None = None,
        probe: StorageProbe | None = None,
    ) -> None:
        self.settings = settings
        self._clock = clock or SystemClock()
        self._crash = Faults.from_settings(settings)
        self._probe: StorageProbe = probe or NullProbe()
        self._wal: Wal = wal or self._open_wal()
        self._index: Index | None = None
        self._compactor: Compactor | None = None
        self._log_ids = LogIdAllocator(settings.ledgers_dir)
        self._writer = EntryLogWriter(settings, self._log_ids)
        self._reader = EntryLogReader(settings, self._clock.monotonic)
        self._ledgers: dict[int, LedgerMeta] = {}
        self._durable_above_lac: dict[int, set[int]] = {}  # durable ids past a hole
        self._lac_waiters: dict[int, list[tuple[int, asyncio.Future[int]]]] = {}
        self._dirty: set[int] = set()  # ledgers whose metadata changed since the last swap
        self._next_ledger_id = 0
        self._cache = WriteCache()
        self._flushing: WriteCache | None = None
        self._flush_finished: asyncio.Future[None] | None = None
        self._read_cache = ReadCache(
            settings.db_storage_read_ahead_cache_max_size, settings.db_storage_read_cache_segments
        )
        self._half_cache = settings.db_storage_write_cache_max_size // 2
        self._max_entry_size = settings.max_entry_size
        self._checkpoint_lock = asyncio.Lock()
        self._checkpoint_wanted = asyncio.Event()
        self._checkpoint_forced = False  # the next checkpoint runs even with nothing cached
        self._checkpointer: asyncio.Task[None] | None = None
        self._flush_executor = ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
        self._read_executor = ThreadPoolExecutor(READER_THREADS, thread_name_prefix="reader")
        self._running = False
        # Why adds are refused, by source ("operator", "disk"); empty = writable.
        self._read_only: dict[str, str] = {}
        self._deleting: set[int] = set()  # deletions waiting for the WAL
        # Ledgers whose fence or close the WAL refused for want of space: in memory only.
        self._unjournaled: set[int] = set()
        self._cold: ColdReader | None = None  # reads of offloaded ledgers
        self._deletion_listeners: list[DeletionListener] = []
        self.stats = Stats()
        self.last_checkpoint_mark = LogMark(0, 0)

    # --- start and stop ------------------------------------------------------------------

    async def start(self) -> None:
        """Open the index, load ledger metadata, replay the WAL from the last mark, then
        checkpoint so that the replayed entries are in entry logs before serving."""
        loop = asyncio.get_running_loop()
        self._index = await loop.run_in_executor(
            self._flush_executor, Index, self.settings.index_dir
        )
        self._compactor = Compactor(
            self.settings, self._index, self._reader, self._log_ids, self.run_serialized,
            self._crash,
        )  # fmt: skip
        await loop.run_in_executor(self._flush_executor, self._recover)
        await self._wal.start()
        self._running = True
        try:
            await self.checkpoint()
        except Exception as e:
            # A full disk must not keep the node down: it serves reads, read-only, with
            # the replayed entries in the write cache, and the checkpointer retries.
            if not is_no_space(e):
                raise
            self._no_space(f"no space left for a checkpoint: {e}")
            log.error("the checkpoint after replay failed for want of space (%s)", e)
        self._checkpointer = loop.create_task(self._checkpoint_loop(), name="checkpointer")

    def _recover(self) -> None:
        """Blocking, before the node serves: nothing else touches the state meanwhile.

        Runs of fresh consecutive entries of one ledger are put back as one batch: the WAL
        hands batch records on whole and gathers single records into runs (wal.replay_runs).
        A long journal is flushed as it
        is replayed: each chunk of the write cache on a thread of its own while the scan
        goes on (its pwrites, fsync and index write overlap the scan), keeping the old
        mark, so that a crash meanwhile replays again from it (which is idempotent)."""
        assert self._index is not None
        self._ledgers = self._index.load_ledgers()
        for meta in self._ledgers.values():
            if meta.state != LedgerState.DELETED and meta.last_entry_id > meta.lac:
                for entry_id in self._index.entry_ids(meta.ledger_id, meta.lac + 1):
                    self._on_durable(meta, entry_id)
        mark = self._wal.last_mark()
        self.last_checkpoint_mark = mark
        chunk = max(1, self._half_cache // REPLAY_FLUSH_CHUNKS)
        flushing: _ReplayChunk | None = None
        flush_as_we_go = True
        with ThreadPoolExecutor(1, thread_name_prefix="replay-flush") as flusher:
            for record, crc in self._wal.replay(mark):
                if isinstance(record, EntryRun):
                    self._replay_batch(record)
                else:
                    self.stats.replayed_records += 1
                    self._replay(record, crc)
                if flush_as_we_go and self._cache.size >= chunk:
                    if flushing is not None:
                        flush_as_we_go = self._replay_flushed(flushing)
                    flushing = self._replay_flush(flusher) if flush_as_we_go else None
            if flushing is not None:
                self._replay_flushed(flushing)
        self._next_ledger_id = max(max(self._ledgers, default=-1) + 1, self._index.next_ledger_id())
        log.info(
            "recovered %d ledgers, replayed %d WAL records from %s",
            len(self._ledgers),
            self.stats.replayed_records,
            mark,
        )

    def _replays_entries(self, meta: LedgerMeta) -> bool:
        """Whether replay puts the ledger's entries back (not a deleted ledger's, nor those
        of one whose entries live in the object store now)."""
        if meta.state == LedgerState.DELETED:
            return False
        return meta.offload is None or not meta.offload.local_deleted

    def _replay_batch(self, batch: EntryRun) -> None:
        """A batch record or a run: put back as one batch when its entries are fresh (at the
        ids after the ledger's last one), else record by record."""
        self.stats.replayed_records += len(batch.payloads)
        meta = self._ledgers.get(batch.ledger_id)
        first = batch.first_entry_id
        if (
            meta is not None
            and batch.payloads
            and first == meta.last_entry_id + 1
            and self._replays_entries(meta)
        ):
            self._cache_batch(meta, first, batch.crcs, batch.payloads)
            self._on_durable_range(meta, first, first + len(batch.payloads) - 1)
            return
        for record, crc in zip(batch.records(), batch.crcs, strict=True):
            self._replay(record, crc)

    def _replay_flush(self, flusher: ThreadPoolExecutor) -> _ReplayChunk:
        """Hand the write cache to ``flusher`` (without a mark: replay is not over)."""
        frozen, self._cache = self._cache, WriteCache()
        self._flushing = frozen  # where replay looks for entries it may meet again
        metas = self._snapshot_dirty()
        future = flusher.submit(self._flush, frozen, metas, self._deleted_ids(), None)
        return _ReplayChunk(frozen, metas, future)

    def _replay_flushed(self, chunk: _ReplayChunk) -> bool:
        """Wait for a chunk's flush; False if the disk was too full for it. Then its
        entries go back into the write cache (the journal since the mark, which a disk this
        full keeps small) and the node starts read-only."""
        try:
            chunk.future.result()
        except OSError as e:
            if not is_no_space(e):
                raise
            log.error("replay cannot flush for want of space (%s)", e)
            for lid, eid, crc, payload in chunk.frozen.sorted_entries():
                if self._cache.get(lid, eid) is None:  # else replayed again since: newer
                    self._cache.put(lid, eid, crc, payload)
            self._dirty.update(m.ledger_id for m in chunk.metas)
            return False
        finally:
            self._flushing = None
        return True

    def _replay(self, record: WalRecord, crc: int | None) -> None:
        ledger_id, entry_id, payload = record
        meta = self._ledgers.get(ledger_id)
        if entry_id == LEDGER_CREATED:
            if meta is None:
                self._ledgers[ledger_id] = LedgerMeta.decode(ledger_id, payload)
                self._dirty.add(ledger_id)
            return
        if meta is None or meta.state == LedgerState.DELETED:
            return  # deleted since (or its creation was lost with a torn tail)
        if entry_id >= 0 and meta.offload is not None and meta.offload.local_deleted:
            return  # its entries live in the object store now: never back into the logs
        self._dirty.add(ledger_id)
        if entry_id >= 0:
            known = entry_id <= meta.last_entry_id and (
                self._cache.get(ledger_id, entry_id) is not None
                or (
                    self._flushing is not None
                    and self._flushing.get(ledger_id, entry_id) is not None
                )
                or self.index.get_location(ledger_id, entry_id) is not None
            )
            if not known:
                if crc is None:
                    crc = record_crc(ledger_id, entry_id, payload)
                self._cache.put(ledger_id, entry_id, crc, bytes(payload))
                self._count_entry(meta, entry_id, len(payload))
            self._on_durable(meta, entry_id)
        elif entry_id == FENCE:
            if meta.state == LedgerState.OPEN:
                meta.state = LedgerState.FENCED
        elif entry_id == CLOSE:
            if meta.state != LedgerState.CLOSED:
                meta.state = LedgerState.CLOSED
                meta.closed_ms = meta.closed_ms or self._clock.now_ms()
        elif entry_id == DELETE:
            meta.state = LedgerState.DELETED
        elif entry_id == EXPLICIT_LAC:
            meta.lac = max(meta.lac, I64.unpack(payload)[0])
        else:
            log.warning("skipping unknown WAL record kind %d of ledger %d", entry_id, ledger_id)

    async def close(self) -> None:
        """Graceful stop: a final checkpoint, roll the entry log so it carries its map,
        close the WAL. The next start replays nothing."""
        if not self._running:
            return
        self._running = False
        if self._checkpointer is not None:
            self._checkpoint_wanted.set()  # the loop sees _running is off and returns
            await self._checkpointer
        try:
            await self.checkpoint(force=True)
        except Exception as e:
            # Nothing is lost: the WAL holds everything since the last mark, and the next
            # start replays it. Stopping goes on, so the WAL and files close cleanly.
            log.error("the final checkpoint failed (%s); the next start replays the WAL", e)
        await self._wal.close()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._flush_executor, self._close_files)
        for waiters in self._lac_waiters.values():
            for _after, waiter in waiters:
                if not waiter.done():
                    waiter.set_exception(StorageClosed("the node is shutting down"))
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

    # --- ledgers ---------------------------------------------------------------------------

    async def create_ledger(
        self,
        ledger_id: int | None = None,
        properties: dict[str, str] | None = None,
        write_token: str | None = None,
    ) -> tuple[LedgerMeta, bool]:
        """Create a ledger (node-allocated id when None). Returns (metadata, created):
        creating an existing open ledger with the same id again is a no-op."""
        self._check_writable()
        if ledger_id is None:
            ledger_id = self._allocate_ledger_id()
        elif not 0 <= ledger_id <= MAX_ID:
            raise InvalidArgument(f"ledger id {ledger_id} is outside [0, 2^63)")
        existing = self._ledgers.get(ledger_id)
        if existing is not None:
            if existing.state == LedgerState.DELETED:
                raise LedgerExists(f"ledger {ledger_id} was deleted; its id is not reusable")
            if (properties or {}) != existing.properties or _digest(write_token) != (
                existing.token_digest
            ):
                raise LedgerExists(f"ledger {ledger_id} exists with other properties or token")
            return existing, False
        meta = LedgerMeta(
            ledger_id,
            created_ms=self._clock.now_ms(),
            token_digest=_digest(write_token),
            properties=dict(properties or {}),
        )
        self._ledgers[ledger_id] = meta
        self._next_ledger_id = max(self._next_ledger_id, ledger_id + 1)
        self._dirty.add(ledger_id)
        try:
            await self._journal(ledger_id, LEDGER_CREATED, meta.encode())
        except (DiskFull, Backpressure):  # the WAL refused it: not written
            # Not in the WAL: forget the ledger. Kept, a retry would find it and answer at
            # once, and a crash before the next checkpoint would lose it, and with it every
            # entry acknowledged to it since (replay drops entries of unknown ledgers).
            if self._ledgers.get(ledger_id) is meta:
                del self._ledgers[ledger_id]
                self._dirty.discard(ledger_id)
            raise
        return meta, True

    def _allocate_ledger_id(self) -> int:
        """One past the highest id in use; once a client has taken the highest possible
        id, the lowest free one (ids of deleted ledgers stay taken until GC)."""
        if self._next_ledger_id <= MAX_ID:
            return self._next_ledger_id
        ledger_id = 0
        while ledger_id in self._ledgers:
            ledger_id += 1
        return ledger_id

    def ledger(self, ledger_id: int) -> LedgerMeta:
        meta = self._ledgers.get(ledger_id)
        if meta is None or meta.state == LedgerState.DELETED:
            raise LedgerNotFound(f"ledger {ledger_id} does not exist")
        return meta

    def ledgers(self) -> Iterable[LedgerMeta]:
        return (m for m in self._ledgers.values() if m.state != LedgerState.DELETED)

    def all_ledgers(self) -> Iterable[LedgerMeta]:
        """Every ledger the node knows, deleted ones (tombstones until GC) included."""
        return self._ledgers.values()

    async def fence(self, ledger_id: int, write_token: str | None = None) -> int:
        """No add succeeds after this returns; returns the LAC (BookKeeper's fence read).
        A ledger's write token is asked for as for adds (BookKeeper's master key)."""
        meta = self.ledger(ledger_id)
        _check_token(meta, write_token)
        try:
            if meta.state == LedgerState.OPEN:
                meta.state = LedgerState.FENCED
                self._dirty.add(ledger_id)
                await self._journal_state(meta)
            elif ledger_id in self._unjournaled:
                await self._journal_state(meta)
            else:
                await self._wal.sync_point()  # in-flight adds settle before the LAC is read
        finally:
            self._answer_lac_waiters(meta)
        return meta.lac

    async def close_ledger(self, ledger_id: int, write_token: str | None = None) -> LedgerMeta:
        """Seal the ledger: its last entry is fixed (adds in flight finish first)."""
        meta = self.ledger(ledger_id)
        _check_token(meta, write_token)
        try:
            if meta.state != LedgerState.CLOSED:
                meta.state = LedgerState.CLOSED
                meta.closed_ms = self._clock.now_ms()
                self._dirty.add(ledger_id)
                await self._journal_state(meta)
            elif ledger_id in self._unjournaled:
                await self._journal_state(meta)
            else:
                await self._wal.sync_point()
        finally:
            self._answer_lac_waiters(meta)
        return meta

    async def _journal_state(self, meta: LedgerMeta) -> None:
        """Journal that the ledger is fenced or closed. If the WAL refuses it for want of
        space, the state stays in memory (stricter: adds stay refused) but is durable only
        after the next checkpoint, so a retry journals it again instead of answering at
        once, and a fence or close is never acknowledged that a crash would undo."""
        ledger_id = meta.ledger_id
        if meta.state == LedgerState.CLOSED:
            kind, payload = CLOSE, I64.pack(meta.last_entry_id)
        else:
            kind, payload = FENCE, b""
        try:
            await self._journal(ledger_id, kind, payload)
        except (DiskFull, Backpressure):
            self._unjournaled.add(ledger_id)
            raise
        self._unjournaled.discard(ledger_id)

    async def delete_ledger(self, ledger_id: int, write_token: str | None = None) -> None:
        """Entries become unreadable at once; GC reclaims their space later."""
        meta = self.ledger(ledger_id)
        _check_token(meta, write_token)
        before = meta.state
        meta.state = LedgerState.DELETED
        self._dirty.add(ledger_id)
        above = self._durable_above_lac.pop(ledger_id, set())
        for _after, waiter in self._lac_waiters.pop(ledger_id, []):
            if not waiter.done():
                waiter.set_exception(LedgerNotFound(f"ledger {ledger_id} was deleted"))
        self._deleting.add(ledger_id)  # not purged before the WAL holds the deletion
        try:
            await self._journal(ledger_id, DELETE, b"")
        except (DiskFull, Backpressure):
            # Not in the WAL: the ledger is back, rather than gone until a crash brings it
            # back (the client retries the delete once there is space). Dirty again: a
            # checkpoint meanwhile may have written the deletion to the index.
            if meta.state == LedgerState.DELETED and self._ledgers.get(ledger_id) is meta:
                meta.state = before
                self._dirty.add(ledger_id)
                for entry_id in sorted(above):
                    self._on_durable(meta, entry_id)
            raise
        finally:
            self._deleting.discard(ledger_id)
        for listener in self._deletion_listeners:
            try:
                await listener(meta)
            except Exception:
                # The ledger is deleted; what the listener left (offloaded objects) stays
                # recorded with the tombstone, and its owner retries (purge waits for it).
                log.exception("a deletion listener failed for ledger %d", ledger_id)

    async def set_explicit_lac(self, ledger_id: int, lac: int) -> int:
        """Raise the LAC to ``lac`` (never lowers it); entries up to it must be durable."""
        meta = self.ledger(ledger_id)
        if lac > meta.last_entry_id:
            raise InvalidArgument(f"LAC {lac} is past the last entry {meta.last_entry_id}")
        await self._journal(ledger_id, EXPLICIT_LAC, I64.pack(lac))
        if lac > meta.lac:
            meta.lac = lac
            self._dirty.add(ledger_id)
            self._wake_lac_waiters(meta)
        return meta.lac

    async def _journal(self, ledger_id: int, kind: int, payload: bytes) -> None:
        await self._wal.append(ledger_id, kind, record_crc(ledger_id, kind, payload), payload)

    # --- adds ------------------------------------------------------------------------------

    async def add_entry(
        self,
        ledger_id: int,
        entry_id: int | None,
        payload: bytes,
        write_token: str | None = None,
    ) -> int:
        """Add one entry (at the next id when ``entry_id`` is None); returns its id once it
        is durable. Adding identical bytes again is a no-op; different bytes conflict."""
        self._check_size(len(payload))
        if self._cache.size >= self._half_cache:
            await self._throttle()
        meta = self._writable(ledger_id, write_token)
        if entry_id is None:
            self._check_ids_left(meta, 1)
            entry_id = meta.last_entry_id + 1
        elif not 0 <= entry_id <= MAX_ID:
            raise InvalidArgument(f"entry id {entry_id} is outside [0, 2^63)")
        elif entry_id <= meta.last_entry_id:
            await self._add_again(meta, entry_id, payload, write_token)
            return entry_id
        future = self._append_now(meta, entry_id, payload)
        try:
            await future
        except BaseException as error:
            self._appends_failed(meta, future, error, lambda: [(entry_id, payload, future)])
            raise
        self._on_durable(meta, entry_id)
        return entry_id

    def begin_add(
        self, ledger_id: int, payload: bytes, write_token: str | None = None
    ) -> PendingAdd | None:
        """``add_entry`` at the next id without a coroutine, for the HTTP fast lane: the add
        as far as it goes without waiting (checked, cached, queued in the WAL), or None
        when it would have to wait for the write cache (then ``add_entry`` does it). Once
        the add's future is done, ``finish_add`` settles it."""
        self._check_size(len(payload))
        if self._cache.size >= self._half_cache:
            return None
        meta = self._writable(ledger_id, write_token)
        self._check_ids_left(meta, 1)
        entry_id = meta.last_entry_id + 1
        return PendingAdd(meta, entry_id, payload, self._append_now(meta, entry_id, payload))

    def finish_add(self, add: PendingAdd) -> int:
        """The entry id of a ``begin_add`` whose future is done, now counted toward the LAC;
        or its error, the refused entry forgotten as ``add_entry`` forgets it. No caller can
        give up in between (nothing awaits), so the entry always settles here."""
        error = add.future.exception()
        if error is not None:
            if isinstance(error, DiskFull | Backpressure):
                self._settle_refused(add.meta, [(add.entry_id, add.payload, add.future)])
            raise error
        self._on_durable(add.meta, add.entry_id)
        return add.entry_id

    async def add_entries(
        self, ledger_id: int, payloads: list[bytes], write_token: str | None = None
    ) -> list[int]:
        """Append a batch at the next ids; one durable acknowledgment for all of them."""
        for payload in payloads:
            self._check_size(len(payload))
        if self._cache.size >= self._half_cache:
            await self._throttle()
        meta = self._writable(ledger_id, write_token)
        # Before the first append: a batch is acknowledged or refused whole, never cut
        # in two with its head journaled.
        self._check_ids_left(meta, len(payloads))
        first = meta.last_entry_id + 1
        ids = list(range(first, first + len(payloads)))
        if not payloads:
            return ids
        # The batch is the unit of work: one cache update, one journal part, one count and
        # one LAC step, instead of a pass through the single-entry path per entry.
        ledger_id = meta.ledger_id
        crcs = [record_crc(ledger_id, eid, p) for eid, p in zip(ids, payloads, strict=True)]
        self._cache_batch(meta, first, crcs, payloads)
        future = self._wal.append_batch(ledger_id, first, crcs, payloads)
        if self._cache.size >= self._half_cache:
            self._checkpoint_wanted.set()
        try:
            await future
        except BaseException as error:
            self._appends_failed(
                meta,
                future,
                error,
                lambda: [(eid, p, future) for eid, p in zip(ids, payloads, strict=True)],
            )
            raise
        self._on_durable_range(meta, first, ids[-1])
        return ids

    def _cache_batch(
        self, meta: LedgerMeta, first: int, crcs: Sequence[int], payloads: list[bytes]
    ) -> None:
        """Cache fresh entries at ids ``first`` on and count them (an add's batch, or a run
        replay puts back)."""
        self._cache.put_batch(meta.ledger_id, first, crcs, payloads)
        size = sum(map(len, payloads))
        meta.entries += len(payloads)
        meta.payload_bytes += size
        meta.last_entry_id = max(meta.last_entry_id, first + len(payloads) - 1)
        self.stats.adds += len(payloads)
        self.stats.add_bytes += size
        self._dirty.add(meta.ledger_id)

    def _check_ids_left(self, meta: LedgerMeta, count: int) -> None:
        if count > MAX_ID - meta.last_entry_id:
            raise LedgerFull(
                f"ledger {meta.ledger_id} has room for {MAX_ID - meta.last_entry_id} more "
                f"entries, not {count}: entry ids end at 2^63 - 1"
            )

    def _append_now(
        self, meta: LedgerMeta, entry_id: int, payload: bytes
    ) -> asyncio.Future[LogMark]:
        ledger_id = meta.ledger_id
        crc = record_crc(ledger_id, entry_id, payload)
        self._cache.put(ledger_id, entry_id, crc, payload)
        future = self._wal.append(ledger_id, entry_id, crc, payload)
        self._count_entry(meta, entry_id, len(payload))
        self._dirty.add(ledger_id)
        if self._cache.size >= self._half_cache:
            self._checkpoint_wanted.set()
        return future

    def _appends_failed(
        self,
        meta: LedgerMeta,
        last: asyncio.Future[LogMark],
        error: BaseException,
        appended: Callable[[], list[tuple[int, bytes, asyncio.Future[LogMark]]]],
    ) -> None:
        """Called when awaiting ``last``, the future of the last of some appends (groups
        complete in order: it covers them all), raised ``error``; the caller re-raises it.
        (A plain try/except around the await at each call site, not a coroutine wrapping
        it: one frame less on every add's wake-up.)

        If the WAL refused the appends for want of space, their bytes are not in it and
        never will be: forget them (write cache, counts, last entry id), so that a retry of
        the same ids is a fresh add (not an "identical bytes" no-op answered from the
        cache), the next ids handed out leave no hole that the LAC cannot pass, and no
        checkpoint writes an entry that a client was told failed. ``appended`` lists
        (entry id, payload, future) of each append, made only on these rare paths."""
        if isinstance(error, DiskFull | Backpressure):
            self._settle_refused(meta, appended())
        elif isinstance(error, asyncio.CancelledError):
            # The caller gave up, not the WAL: the records are queued and land anyway, and
            # the LAC must pass them when they do (else it would stop at them for good).
            pending = appended()
            last.add_done_callback(lambda done: self._settle_abandoned(meta, pending, done))

    def _settle_refused(
        self, meta: LedgerMeta, appended: list[tuple[int, bytes, asyncio.Future[LogMark]]]
    ) -> None:
        failed = []
        for entry_id, payload, future in appended:
            if future.done() and not future.cancelled() and future.exception() is None:
                self._on_durable(meta, entry_id)  # an earlier write of the batch landed
            else:
                failed.append((entry_id, payload))
        self._forget_appends(meta, failed)

    def _settle_abandoned(
        self,
        meta: LedgerMeta,
        appended: list[tuple[int, bytes, asyncio.Future[LogMark]]],
        done: asyncio.Future[LogMark],
    ) -> None:
        error = None if done.cancelled() else done.exception()
        if error is None and not done.cancelled():
            for entry_id, _payload, _future in appended:
                self._on_durable(meta, entry_id)
        elif isinstance(error, DiskFull | Backpressure):
            self._settle_refused(meta, appended)

    def _forget_appends(self, meta: LedgerMeta, failed: list[tuple[int, bytes]]) -> None:
        ledger_id = meta.ledger_id
        for entry_id, payload in failed:
            # Only the bytes this add cached. A checkpoint's frozen cache may hold them: its
            # mark covers this append and failed with it, so no flush thread reads it.
            for cache in (self._cache, self._flushing):
                if cache is not None and cache.get(ledger_id, entry_id) is payload:
                    cache.remove(ledger_id, entry_id)
            meta.entries -= 1
            meta.payload_bytes -= len(payload)
        if any(entry_id >= meta.last_entry_id for entry_id, _payload in failed):
            above = self._durable_above_lac.get(ledger_id, ())
            meta.last_entry_id = max(
                meta.lac,
                max(above, default=-1),
                self._cache.highest_entry_id(ledger_id),
                self._flushing.highest_entry_id(ledger_id) if self._flushing else -1,
            )
        if self._ledgers.get(ledger_id) is meta:
            self._dirty.add(ledger_id)

    def _count_entry(self, meta: LedgerMeta, entry_id: int, size: int) -> None:
        meta.entries += 1
        meta.payload_bytes += size
        if entry_id > meta.last_entry_id:
            meta.last_entry_id = entry_id
        self.stats.adds += 1
        self.stats.add_bytes += size

    async def _add_again(
        self, meta: LedgerMeta, entry_id: int, payload: bytes, write_token: str | None
    ) -> None:
        """An id at or below the last one: a retry (identical bytes), a conflict, or the
        filling of a hole."""
        existing = self._cached(meta.ledger_id, entry_id)
        if existing is None:
            existing = await self._read_stored(meta.ledger_id, entry_id)
        if existing is None:
            meta = self._writable(meta.ledger_id, write_token)  # re-checked after the await
            if self._cached(meta.ledger_id, entry_id) is None:
                future = self._append_now(meta, entry_id, payload)
                try:
                    await future
                except BaseException as error:
                    self._appends_failed(meta, future, error, lambda: [(entry_id, payload, future)])
                    raise
                self._on_durable(meta, entry_id)
                return
            existing = self._cached(meta.ledger_id, entry_id)
        if existing != payload:
            raise EntryConflict(
                f"entry {entry_id} of ledger {meta.ledger_id} exists with different bytes"
            )
        if not self._is_durable(meta, entry_id):
            await self._wal.sync_point()

    async def _throttle(self) -> None:
        """Back-pressure, once the write cache is half full: while the previous flush still
        runs, wait for it up to maxThrottleTime, then refuse (retryable)."""
        self._check_running()
        self._checkpoint_wanted.set()
        if self._flushing is None:
            return
        self.stats.throttled_adds += 1
        deadline = self._clock.monotonic() + self.settings.db_storage_max_throttle_time_ms / 1000
        while self._cache.size >= self._half_cache and self._flush_finished is not None:
            remaining = deadline - self._clock.monotonic()
            try:
                await asyncio.wait_for(asyncio.shield(self._flush_finished), max(remaining, 0))
            except TimeoutError:
                self.stats.rejected_adds += 1
                raise Backpressure(
                    "write cache full while a flush is running; retry later"
                ) from None

    def _check_size(self, size: int) -> None:
        if size > self._max_entry_size:
            raise EntryTooLarge(
                f"entry of {size} bytes exceeds max_entry_size {self.settings.max_entry_size}"
            )

    def _writable(self, ledger_id: int, write_token: str | None) -> LedgerMeta:
        meta = self._ledgers.get(ledger_id)
        # Every add passes here: the common case (running, writable, an open ledger without
        # a token) in one test, the checks below in their order for the rest.
        if (
            meta is not None
            and meta.state is _OPEN
            and not meta.token_digest
            and self._running
            and not self._read_only
        ):
            return meta
        self._check_writable()
        meta = self.ledger(ledger_id)
        if meta.state == LedgerState.CLOSED:
            raise LedgerClosed(f"ledger {ledger_id} is closed")
        if meta.state == LedgerState.FENCED:
            raise LedgerFenced(f"ledger {ledger_id} is fenced")
        _check_token(meta, write_token)
        return meta

    def _check_running(self) -> None:
        if not self._running:
            raise StorageClosed("the storage is not running")

    def _check_writable(self) -> None:
        self._check_running()
        if self._read_only:
            if DISK in self._read_only:
                raise DiskFull(f"the node is read-only: {self._read_only[DISK]}")
            raise NodeReadOnly(f"the node is read-only: {self.read_only_reason}")

    def set_read_only(self, reason: str | None, source: str = OPERATOR) -> None:
        """Refuse adds and new ledgers for ``reason``, or (None) lift what ``source`` set.
        An operator's read-only mode outlasts a disk that recovers, and the other way
        round (BookKeeper: a manual transition is sticky). Reads, fence, close and delete
        go on: they are how a full node recovers."""
        before = self.read_only_reason
        if reason is None:
            self._read_only.pop(source, None)
        else:
            self._read_only[source] = reason
        if self.read_only_reason != before:
            now = f"read-only: {self.read_only_reason}" if self._read_only else "writable"
            log.warning("node is now %s", now)

    def read_only_source(self, source: str) -> bool:
        return source in self._read_only

    @property
    def read_only_reason(self) -> str | None:
        return "; ".join(self._read_only.values()) or None

    @property
    def running(self) -> bool:
        return self._running

    @property
    def wal_failure(self) -> str | None:
        """Why the WAL failed for good (adds answer 500 ``journal_failed`` until a restart)."""
        return self._wal.failure

    @property
    def refuses_adds(self) -> bool:
        """Read-only (an operator, a full disk), or a WAL that failed for good."""
        return bool(self._read_only) or self._wal.failure is not None

    @property
    def lac_waiters(self) -> int:
        """Long polls waiting for a LAC to pass."""
        waiters = self._lac_waiters.values()
        return sum(not waiter.done() for pending in waiters for _after, waiter in pending)

    # --- LAC -------------------------------------------------------------------------------

    def _on_durable(self, meta: LedgerMeta, entry_id: int) -> None:
        """LAC = the highest id such that every entry up to it is durable."""
        if entry_id <= meta.lac:
            return
        if entry_id != meta.lac + 1:
            self._durable_above_lac.setdefault(meta.ledger_id, set()).add(entry_id)
            return
        lac = entry_id
        above = self._durable_above_lac.get(meta.ledger_id)
        if above:
            while lac + 1 in above:
                lac += 1
                above.discard(lac)
            if not above:
                del self._durable_above_lac[meta.ledger_id]
        meta.lac = lac
        if meta.ledger_id in self._lac_waiters:
            self._wake_lac_waiters(meta)

    def _on_durable_range(self, meta: LedgerMeta, first: int, last: int) -> None:
        """``_on_durable`` for entries ``first`` to ``last``: one step when they extend the
        LAC and nothing above it waits."""
        if first == meta.lac + 1 and meta.ledger_id not in self._durable_above_lac:
            meta.lac = last
            if meta.ledger_id in self._lac_waiters:
                self._wake_lac_waiters(meta)
            return
        for entry_id in range(first, last + 1):
            self._on_durable(meta, entry_id)

    def _wake_lac_waiters(self, meta: LedgerMeta) -> None:
        waiters = self._lac_waiters.get(meta.ledger_id)
        if not waiters:
            return
        keep = []
        for after, waiter in waiters:
            if waiter.done():
                continue
            if meta.lac > after:
                waiter.set_result(meta.lac)
            else:
                keep.append((after, waiter))
        if keep:
            self._lac_waiters[meta.ledger_id] = keep
        else:
            del self._lac_waiters[meta.ledger_id]

    def _answer_lac_waiters(self, meta: LedgerMeta) -> None:
        """Answer the ledger's long polls now with its LAC: fenced or closed (the adds in
        flight settled), it will not pass what they wait for."""
        for _after, waiter in self._lac_waiters.pop(meta.ledger_id, []):
            if not waiter.done():
                waiter.set_result(meta.lac)

    async def wait_lac(self, ledger_id: int, after: int, timeout_s: float) -> int:
        """Long-poll: the LAC once it passes ``after``, or the current LAC at the timeout
        or as soon as the ledger is fenced or closed (no add moves it any more)."""
        meta = self.ledger(ledger_id)
        if meta.lac > after or timeout_s <= 0 or meta.state in _SEALED:
            return meta.lac
        waiter: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._lac_waiters.setdefault(ledger_id, []).append((after, waiter))
        try:
            return await asyncio.wait_for(waiter, timeout_s)
        except TimeoutError:
            return self.ledger(ledger_id).lac
        finally:
            self._forget_lac_waiter(ledger_id, waiter)

    def _forget_lac_waiter(self, ledger_id: int, waiter: asyncio.Future[int]) -> None:
        """A poll that timed out or was cancelled leaves no trace: on a ledger no add comes
        to, a flood of them would otherwise be kept for good."""
        pending = self._lac_waiters.get(ledger_id)
        if pending is None:
            return  # answered: its list was taken whole
        keep = [(after, other) for after, other in pending if other is not waiter]
        if keep:
            self._lac_waiters[ledger_id] = keep
        else:
            del self._lac_waiters[ledger_id]

    def release_waiters(self) -> None:
        """Answer every long poll now with the current LAC (at shutdown)."""
        waiters, self._lac_waiters = self._lac_waiters, {}
        for ledger_id, pending in waiters.items():
            lac = self._ledgers[ledger_id].lac
            for _after, waiter in pending:
                if not waiter.done():
                    waiter.set_result(lac)

    def _is_durable(self, meta: LedgerMeta, entry_id: int) -> bool:
        if entry_id <= meta.lac:
            return True
        above = self._durable_above_lac.get(meta.ledger_id)
        return above is not None and entry_id in above

    # --- reads -----------------------------------------------------------------------------

    def _cached(self, ledger_id: int, entry_id: int) -> bytes | None:
        found = self._cache.get(ledger_id, entry_id)
        if found is None and self._flushing is not None:
            found = self._flushing.get(ledger_id, entry_id)
        return found

    async def read_entry(self, ledger_id: int, entry_id: int) -> bytes:
        """The payload of a durable entry; EntryNotFound for anything not (yet) durable."""
        meta = self.ledger(ledger_id)
        if not self._is_durable(meta, entry_id):
            raise EntryNotFound(f"entry {entry_id} of ledger {ledger_id} does not exist")
        if self._reads_cold(meta):
            assert self._cold is not None
            cold = await self._cold.read(meta, entry_id)
            self.ledger(ledger_id)  # deleted while we read
            self.stats.reads += 1
            self.stats.read_bytes += len(cold)
            return cold
        found = self._cached(ledger_id, entry_id)
        if found is None:
            found = self._read_cache.get(ledger_id, entry_id)
        if found is None:
            found = await self._read_stored(ledger_id, entry_id)
            meta = self.ledger(ledger_id)  # deleted while we read
            if found is None and self._reads_cold(meta):
                assert self._cold is not None  # its local copy went while we read
                found = await self._cold.read(meta, entry_id)
            if found is None:
                raise EntryNotFound(f"entry {entry_id} of ledger {ledger_id} is not indexed")
        self.stats.reads += 1
        self.stats.read_bytes += len(found)
        return found

    def _reads_cold(self, meta: LedgerMeta) -> bool:
        offload = meta.offload
        if offload is None or not offload.offloaded:
            return False
        if offload.local_deleted:
            if self._cold is None:
                raise StorageClosed(f"ledger {meta.ledger_id} is offloaded; no reader is set")
            return True
        tiered_first = self.settings.managed_ledger_data_read_priority == "tiered-storage-first"
        return tiered_first and self._cold is not None

    async def _read_stored(self, ledger_id: int, entry_id: int) -> bytes | None:
        """Index -> entry log on a reader thread; read-ahead fills the read cache."""
        run = await asyncio.get_running_loop().run_in_executor(
            self._read_executor, self._read_run, ledger_id, entry_id
        )
        if not run:
            return None
        for eid, payload in run:
            self._read_cache.put(ledger_id, eid, payload)
        return run[0][1]

    def _read_run(self, ledger_id: int, entry_id: int) -> list[tuple[int, bytes]]:
        assert self._index is not None
        cache = self._read_cache
        for _attempt in range(READ_ATTEMPTS):
            loc = self._index.get_location(ledger_id, entry_id)
            if loc is None:
                return []
            try:
                return self._reader.read_run(
                    loc,
                    ledger_id,
                    entry_id,
                    self.settings.db_storage_read_ahead_cache_batch_size,
                    self.settings.db_storage_read_ahead_cache_batch_bytes_size,
                    lambda lid, eid: (lid, eid) in cache,
                )
            except LogRetired:
                continue  # compacted meanwhile: the index has its new location
        raise StorageClosed(f"entry {entry_id} of ledger {ledger_id} kept moving; retry")

    async def read_range(
        self, ledger_id: int, first: int, last: int | None = None
    ) -> AsyncIterator[tuple[int, bytes]]:
        """Durable entries with ids in [first, last] (last defaults to the highest durable
        id), in order, as of the call: up to the LAC every id, past it the ids added at
        chosen positions. Only ids that exist are visited, so an entry added at id 2^62 costs
        one read, not a walk over the hole; the loop gets a turn every chunk."""
        meta = self.ledger(ledger_id)
        start = max(first, 0)
        above = sorted(e for e in self._durable_above_lac.get(ledger_id, ()) if e >= start)
        if last is not None:
            above = above[: bisect.bisect_right(above, last)]
        lac_part = range(start, (meta.lac if last is None else min(last, meta.lac)) + 1)
        chunk = self.settings.range_read_chunk_entries
        for done, entry_id in enumerate(itertools.chain(lac_part, above), 1):
            yield entry_id, await self.read_entry(ledger_id, entry_id)
            if done % chunk == 0:
                await asyncio.sleep(0)  # cached entries never suspend: let others run

    # --- checkpoint ------------------------------------------------------------------------

    def _open_wal(self) -> Wal:
        if self.settings.wal_kind == "blockdev":
            return BlockWal(
                self.settings, self._clock, self._crash, self._probe, self._wal_wants_checkpoint
            )
        return Journal(
            self.settings, self._clock, self._crash, self._probe, on_no_space=self._no_space
        )

    def _no_space(self, reason: str) -> None:
        """A write found the disk full: refuse adds at once (507) rather than fail them one
        write at a time. The disk monitor lifts it once usage is under the low watermark."""
        self.set_read_only(reason, DISK)

    def _wal_wants_checkpoint(self) -> None:
        """The ring is filling up: a checkpoint lets it trim. Forced, as records replayed at
        start hold ring space until one runs, even when nothing is cached."""
        self._checkpoint_forced = True
        self._checkpoint_wanted.set()

    async def _checkpoint_loop(self) -> None:
        interval = self.settings.flush_interval_ms / 1000
        while True:
            await self._clock.wait(self._checkpoint_wanted, interval)
            self._checkpoint_wanted.clear()
            if not self._running:
                return  # close() runs the last checkpoint itself
            force, self._checkpoint_forced = self._checkpoint_forced, False
            try:
                await self.checkpoint(force)
            except Exception as e:
                # The journal still holds everything: retry at the next interval.
                if is_no_space(e):
                    self._no_space(f"no space left for a checkpoint: {e}")
                if is_no_space(e) or isinstance(e, DiskFull):
                    log.error(
                        "checkpoint failed for want of space (%s); reads go on from the "
                        "caches and entry logs, the journal holds every acknowledged entry; "
                        "retrying at the next interval",
                        e,
                    )
                else:
                    log.exception("checkpoint failed; retrying at the next interval")

    async def checkpoint(self, force: bool = False) -> None:
        async with self._checkpoint_lock:
            if not force and not self._cache.count and not self._dirty:
                return
            started = self._clock.monotonic()
            loop = asyncio.get_running_loop()
            frozen, self._cache = self._cache, WriteCache()
            self._flushing = frozen
            self._flush_finished = loop.create_future()
            metas = self._snapshot_dirty()
            deleted = self._deleted_ids()
            try:
                mark = await self._wal.checkpoint_point()
                flush_started = self._clock.monotonic()
                await loop.run_in_executor(
                    self._flush_executor, self._flush, frozen, metas, deleted, mark
                )
                flushed = self._clock.monotonic() - flush_started
            except BaseException as e:
                # Nothing is lost (the WAL holds it); merge back so reads still find it.
                for lid, eid, crc, payload in frozen.sorted_entries(deleted):
                    if self._cache.get(lid, eid) is None:
                        self._cache.put(lid, eid, crc, payload)
                written: set[int] = set()
                if isinstance(e, Exception):
                    written = await self._write_deletions(metas)
                # (not a ledger forgotten meanwhile because the WAL refused its creation)
                self._dirty.update(
                    m.ledger_id
                    for m in metas
                    if m.ledger_id in self._ledgers and m.ledger_id not in written
                )
                raise
            finally:
                self._flushing = None
                self._flush_finished.set_result(None)
                self._flush_finished = None
            self.last_checkpoint_mark = mark
            elapsed = self._clock.monotonic() - started
            self.stats.checkpoints += 1
            self.stats.last_checkpoint_ms = self._clock.now_ms()
            self.stats.flushed_entries += frozen.count
            self.stats.flush_seconds_total += flushed
            self._probe.checkpoint(elapsed, frozen.count, frozen.size)

    async def _write_deletions(self, metas: list[LedgerMeta]) -> set[int]:
        """After a failed checkpoint, make its ledger deletions durable on their own: a
        few bytes of index, where the entries need a whole entry log. On a full disk that
        is what lets GC purge deleted ledgers and give their space back before any
        checkpoint succeeds. Returns the ids written (none if the index cannot write)."""
        deletions = [m for m in metas if m.state == LedgerState.DELETED]
        if not deletions:
            return set()

        def write() -> None:
            self.index.ensure_writable()
            self.index.write((), deletions)

        try:
            await asyncio.get_running_loop().run_in_executor(self._flush_executor, write)
        except OSError as e:
            log.warning("could not record %d ledger deletions either: %s", len(deletions), e)
            return set()
        return {m.ledger_id for m in deletions}

    def _crash_if(self, ledgers: list[LedgerEntries], point: str) -> None:
        """Checkpoint crash points are steps of writing entries: a checkpoint of metadata
        only (ledger creations) does not reach them."""
        if ledgers:
            self._crash.hit(point)

    def _deleted_ids(self) -> frozenset[int]:
        return frozenset(lid for lid, m in self._ledgers.items() if m.state == LedgerState.DELETED)

    def _snapshot_dirty(self) -> list[LedgerMeta]:
        # A dirty id may name a ledger forgotten since (its creation refused by the WAL):
        # nothing of it is to be written. Raising here would strand the swapped cache.
        metas = [dataclasses.replace(m) for lid in self._dirty if (m := self._ledgers.get(lid))]
        self._dirty.clear()
        return metas

    def _flush(
        self,
        frozen: WriteCache,
        metas: list[LedgerMeta],
        deleted: frozenset[int],
        mark: LogMark | None,
    ) -> None:
        """Blocking (flush thread): entry log, fsync, index batch, then the mark."""
        assert self._index is not None
        ledgers = frozen.sorted_ledgers(deleted)
        # An index that failed a write (RocksDB stays read-only after one) is reopened first:
        # copies appended for locations the index cannot take would only fill the disk, once
        # per retry.
        self._index.ensure_writable()
        self._crash_if(ledgers, "checkpoint.before_entrylog")
        try:
            locations = self._writer.append(ledgers)
            self._writer.flush()
        except OSError as e:
            # Nothing of this checkpoint is indexed: cut the log back to its last flush, so
            # that the retry appends where durable data ends (no partial record or hole).
            self._writer.discard_unflushed()
            where = self.settings.ledgers_dir
            raise OSError(e.errno, f"entry log write in {where} failed: {e.strerror or e}") from e
        self._crash_if(ledgers, "checkpoint.after_entrylog_fsync")
        self._index.write(
            (
                (ledger_id, entry_ids, ledger_locations)
                for (ledger_id, entry_ids, _), ledger_locations in zip(
                    ledgers, locations, strict=True
                )
            ),
            metas,
        )
        self._crash_if(ledgers, "checkpoint.after_index")
        if mark is not None:
            self._wal.checkpoint_complete(mark)
            self._crash_if(ledgers, "checkpoint.after_mark")

    # --- garbage collection (driven by node.lifecycle.gc) ----------------------------------

    @property
    def compactor(self) -> Compactor:
        assert self._compactor is not None, "the storage is not started"
        return self._compactor

    def gc_candidate_logs(self) -> list[int]:
        """Blocking, from a worker thread: entry logs that are sealed (not the checkpoint's
        current log, not a compaction output being written, not retired). Taken between
        checkpoints: one that rolls its log has, for a while, no current log but a new
        file holding only a header (GC would delete it as empty, then the checkpoint
        would index records into the deleted file), and a sealed log whose records it
        has not indexed yet (compaction would find them dead and delete the log)."""
        return self.run_serialized(self._sealed_logs)

    def _sealed_logs(self) -> list[int]:
        busy = {self._writer.current_log_id, *self.compactor.in_progress, *self._reader.retired}
        return [i for i in list_logs(self.settings.ledgers_dir) if i not in busy]

    def is_live_ledger(self, ledger_id: int) -> bool:
        """Known to the node (a deleted ledger counts until its index entries are purged,
        so compaction never leaves an index entry pointing at nothing), unless its local
        copy was dropped after an offload (its index entries went in the same batch).
        Thread safe."""
        meta = self._ledgers.get(ledger_id)
        return meta is not None and not (meta.offload is not None and meta.offload.local_deleted)

    async def purge_deleted_ledgers(self) -> list[int]:
        """Forget deleted ledgers whose deletion a checkpoint has made durable: their
        index entries and metadata go in one batch. Returns their ids.

        Under the checkpoint lock: a checkpoint in flight has taken its dirty ledgers out
        of ``_dirty`` before their deletion is durable, and puts them back if it fails;
        a purge between the two would take a deletion that no checkpoint wrote for a
        durable one."""
        async with self._checkpoint_lock:
            ready = [
                lid
                for lid, meta in self._ledgers.items()
                if meta.state == LedgerState.DELETED
                and lid not in self._dirty
                and lid not in self._deleting
                and meta.offload is None  # its objects first (node/offload clears this)
            ]
            if not ready:
                return []
            await asyncio.get_running_loop().run_in_executor(
                self._flush_executor, self.index.delete_ledgers, ready, self._next_ledger_id
            )
            for lid in ready:
                del self._ledgers[lid]  # still deleted: nothing undeletes a ledger
            return ready

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

    # --- tiered storage (driven by node.offload) --------------------------------------------

    def set_cold_reader(self, reader: ColdReader | None) -> None:
        self._cold = reader

    def add_deletion_listener(self, listener: DeletionListener) -> None:
        """``listener(meta)`` runs after each ledger deletion is in the WAL."""
        self._deletion_listeners.append(listener)

    async def record_offload(self, ledger_id: int, info: OffloadInfo | None) -> LedgerMeta:
        """Make a ledger's offload record durable (the index, synchronously), then adopt
        it. Only a closed ledger gets one; None clears it (also of a deleted ledger, once
        its objects are gone, which lets GC purge the ledger)."""
        if ledger_id in self._dirty:
            # Its entries and LAC reach the index first: a record written now would carry a
            # LAC ahead of the locations, which an audit snapshot reads as holes. Closed, the
            # ledger cannot be dirtied again before the lock below.
            await self.checkpoint()
        async with self._checkpoint_lock:  # a checkpoint must not write an older snapshot
            meta = self._ledgers.get(ledger_id)
            if meta is None or (info is not None and meta.state == LedgerState.DELETED):
                raise LedgerNotFound(f"ledger {ledger_id} does not exist")
            if info is not None and meta.state != LedgerState.CLOSED:
                raise InvalidArgument(f"ledger {ledger_id} is not closed")
            if info is not None and meta.offload is not None and meta.offload.local_deleted:
                raise InvalidArgument(f"ledger {ledger_id} has no local copy left")
            updated = dataclasses.replace(meta, offload=info)
            await asyncio.get_running_loop().run_in_executor(
                self._flush_executor, self.index.write, (), [updated]
            )
            meta.offload = info
            return meta

    async def drop_local_copy(self, ledger_id: int) -> LedgerMeta:
        """Forget where an offloaded ledger's entries are in the entry logs (GC reclaims
        them like any deleted data); reads go to the object store from now on. Refused
        unless the offload is recorded as verified."""
        meta = self.ledger(ledger_id)
        if meta.offload is None or meta.offload.state != OffloadState.OFFLOADED:
            raise InvalidArgument(f"ledger {ledger_id} is not offloaded")
        if meta.offload.local_deleted:
            return meta
        if self._cold is None:
            raise InvalidArgument("no reader of offloaded ledgers is set")
        # Entries still cached would be indexed again by a later checkpoint: flush them.
        await self.checkpoint()
        async with self._checkpoint_lock:
            meta = self.ledger(ledger_id)
            cached = self._cache.highest_entry_id(ledger_id) >= 0
            if cached or (self._flushing and self._flushing.highest_entry_id(ledger_id) >= 0):
                raise Backpressure(f"entries of ledger {ledger_id} are still being flushed")
            assert meta.offload is not None
            offload = dataclasses.replace(meta.offload, local_deleted=True)
            updated = dataclasses.replace(meta, offload=offload)
            await asyncio.get_running_loop().run_in_executor(
                self._flush_executor, self.index.drop_locations, updated
            )
            meta.offload = offload
            return meta

    # --- records of the layers above (streams) ---------------------------------------------

    async def write_records(self, changes: dict[bytes, bytes | None]) -> None:
        """Durable, atomic puts and deletes in the streams keyspace."""
        self._check_running()
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
        return self._cache.size + (self._flushing.size if self._flushing else 0)

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


def _digest(token: str | None) -> bytes:
    return hashlib.sha256(token.encode()).digest() if token else b""


def _check_token(meta: LedgerMeta, write_token: str | None) -> None:
    """A ledger created with a write token changes only for a holder of it."""
    if meta.token_digest and not hmac.compare_digest(meta.token_digest, _digest(write_token)):
        raise WriteTokenMismatch(f"wrong or missing write token for ledger {meta.ledger_id}")
