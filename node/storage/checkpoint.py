"""The checkpoint (BookKeeper's SyncThread): the write cache to entry logs and the index,
then the WAL trimmed up to it.

One checkpoint: swap the write cache and seal the WAL group (one synchronous step on the
loop, so no add is split between them) -> wait for that group's fsync -> on the flush
thread: write the frozen cache sorted by (ledger, entry) to the entry log, fsync it, write
the locations and the changed ledger metadata in one RocksDB batch, persist ``lastMark``
and trim the WAL -> drop the frozen cache. A checkpoint that fails loses nothing: the WAL
still holds every entry since the last mark, and the frozen cache goes back into the write
cache so that reads find its entries.

Checkpoints run every ``flush_interval_ms``, when the write cache is half full, and when the
WAL asks (a ring that fills up); they are serial (one flush thread, ``lock``). Adds that
find the write cache half full while a flush runs wait for it (``throttle``), up to
``db_storage_max_throttle_time_ms``, then are refused (retryable).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from node.settings import Settings
from node.storage.cache import WriteCache, WriteCaches
from node.storage.clock import Clock
from node.storage.descriptor import LedgerTable
from node.storage.entrylog import EntryLogWriter, LedgerEntries
from node.storage.errors import Backpressure, DiskFull
from node.storage.faults import Faults
from node.storage.fsutil import is_no_space
from node.storage.index import Index, LedgerMeta, LedgerState
from node.storage.probe import Stats, StorageProbe
from node.storage.wal import LogMark, Wal

log = logging.getLogger(__name__)


class Checkpointer:
    """Runs checkpoints: on request, on a timer, and as the flush step of replay."""

    def __init__(
        self,
        settings: Settings,
        clock: Clock,
        wal: Wal,
        index: Index,
        writer: EntryLogWriter,
        caches: WriteCaches,
        table: LedgerTable,
        stats: Stats,
        probe: StorageProbe,
        crash: Faults,
        flush_executor: ThreadPoolExecutor,
        flush_at: int,
        on_no_space: Callable[[str], None],
    ) -> None:
        self._settings = settings
        self._clock = clock
        self._wal = wal
        self._index = index
        self._writer = writer
        self._caches = caches
        self._table = table
        self._stats = stats
        self._probe = probe
        self._crash = crash
        self._executor = flush_executor
        self._flush_at = flush_at  # write cache bytes that ask for a checkpoint
        self._on_no_space = on_no_space
        # Held by a checkpoint, and by whoever must not interleave with one (purge, offload).
        self.lock = asyncio.Lock()
        self.last_mark = LogMark(0, 0)  # the WAL position the last checkpoint covers
        self._wanted = asyncio.Event()
        self._forced = False  # the next checkpoint runs even with nothing cached
        self._stopping = False
        self._task: asyncio.Task[None] | None = None
        self._flush_finished: asyncio.Future[None] | None = None  # while one flushes

    # --- when ------------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="checkpointer")

    async def stop(self) -> None:
        """End the timer loop (the caller runs the last checkpoint itself)."""
        self._stopping = True
        if self._task is not None:
            self._wanted.set()
            await self._task

    def want(self, force: bool = False) -> None:
        """Ask for a checkpoint now; ``force``: even if nothing is cached (a WAL ring holds
        space for records replayed at start until one runs)."""
        if force:
            self._forced = True
        self._wanted.set()

    async def _loop(self) -> None:
        interval = self._settings.flush_interval_ms / 1000
        while True:
            await self._clock.wait(self._wanted, interval)
            self._wanted.clear()
            if self._stopping:
                return
            force, self._forced = self._forced, False
            try:
                await self.checkpoint(force)
            except Exception as e:
                # The journal still holds everything: retry at the next interval.
                if is_no_space(e):
                    self._on_no_space(f"no space left for a checkpoint: {e}")
                if is_no_space(e) or isinstance(e, DiskFull):
                    log.error(
                        "checkpoint failed for want of space (%s); reads go on from the "
                        "caches and entry logs, the journal holds every acknowledged entry; "
                        "retrying at the next interval",
                        e,
                    )
                else:
                    log.exception("checkpoint failed; retrying at the next interval")

    async def throttle(self) -> None:
        """Back-pressure, once the write cache is half full: while the previous flush still
        runs, wait for it up to maxThrottleTime, then refuse (retryable)."""
        self._wanted.set()
        if self._caches.flushing is None:
            return
        self._stats.throttled_adds += 1
        wait_s = self._settings.db_storage_max_throttle_time_ms / 1000
        deadline = self._clock.monotonic() + wait_s
        while self._caches.current.size >= self._flush_at and self._flush_finished is not None:
            remaining = deadline - self._clock.monotonic()
            try:
                await asyncio.wait_for(asyncio.shield(self._flush_finished), max(remaining, 0))
            except TimeoutError:
                self._stats.rejected_adds += 1
                raise Backpressure(
                    "write cache full while a flush is running; retry later"
                ) from None

    # --- what ------------------------------------------------------------------------------

    async def checkpoint(self, force: bool = False) -> None:
        async with self.lock:
            caches, table = self._caches, self._table
            if not force and not caches.current.count and not table.dirty:
                return
            started = self._clock.monotonic()
            loop = asyncio.get_running_loop()
            frozen = caches.freeze()
            self._flush_finished = loop.create_future()
            metas = table.snapshot_dirty()
            deleted = table.deleted_ids()
            try:
                mark = await self._wal.checkpoint_point()
                flush_started = self._clock.monotonic()
                await loop.run_in_executor(self._executor, self.flush, frozen, metas, deleted, mark)
                flushed = self._clock.monotonic() - flush_started
            except BaseException as e:
                # Nothing is lost (the WAL holds it); merge back so reads still find it.
                caches.put_back(frozen, deleted)
                written: set[int] = set()
                if isinstance(e, Exception):
                    written = await self._write_deletions(metas)
                # (not a ledger forgotten meanwhile because the WAL refused its creation)
                table.dirty.update(
                    m.ledger_id
                    for m in metas
                    if m.ledger_id in table.metas and m.ledger_id not in written
                )
                raise
            finally:
                caches.flushed()
                self._flush_finished.set_result(None)
                self._flush_finished = None
            self.last_mark = mark
            elapsed = self._clock.monotonic() - started
            stats = self._stats
            stats.checkpoints += 1
            stats.last_checkpoint_ms = self._clock.now_ms()
            stats.flushed_entries += frozen.count
            stats.flush_seconds_total += flushed
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
            self._index.ensure_writable()
            self._index.write((), deletions)

        try:
            await asyncio.get_running_loop().run_in_executor(self._executor, write)
        except OSError as e:
            log.warning("could not record %d ledger deletions either: %s", len(deletions), e)
            return set()
        return {m.ledger_id for m in deletions}

    def flush(
        self,
        frozen: WriteCache,
        metas: list[LedgerMeta],
        deleted: frozenset[int],
        mark: LogMark | None,
    ) -> None:
        """Blocking (flush thread): entry log, fsync, index batch, then the mark (None:
        replay's flushes, which keep the old mark until replay is over)."""
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
            where = self._settings.ledgers_dir
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

    def _crash_if(self, ledgers: list[LedgerEntries], point: str) -> None:
        """Checkpoint crash points are steps of writing entries: a checkpoint of metadata
        only (ledger creations) does not reach them."""
        if ledgers:
            self._crash.hit(point)
