"""Replay at start: the ledger table from the index, then the WAL from the last mark.

Blocking, before the node serves: nothing else touches the state meanwhile. A replicated
ledger comes back with its replication, its fence (a FENCE record, or a creation FENCED by a
fencing read) and the entries acknowledged after a fence (a recovery's re-adds). What replay
puts back is what every acknowledged add, fence, close, delete and explicit LAC left in the
WAL since the last checkpoint; it is idempotent (an entry already cached or indexed is
not put back twice), so a crash during replay just replays again.

Runs of fresh consecutive entries of one ledger are put back as one batch: the WAL hands
batch records on whole and gathers single records into runs (``wal.replay_runs``). A long
journal is flushed as it is replayed: each chunk of the write cache goes to a thread of its
own while the scan goes on (its pwrites, fsync and index write overlap the scan), keeping
the old mark, so that a crash meanwhile replays again from it. A disk too full for those
flushes stops them: the rest stays in the write cache and the node starts read-only.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from node.storage.cache import WriteCache, WriteCaches
from node.storage.checkpoint import Checkpointer
from node.storage.clock import Clock
from node.storage.descriptor import LedgerTable, count_added
from node.storage.fsutil import is_no_space
from node.storage.index import Index, LedgerMeta, LedgerState
from node.storage.lac import LacTracker
from node.storage.probe import Stats
from node.storage.transitions import I64  # the payload of CLOSE and EXPLICIT_LAC
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

# Replay flushes as it goes in chunks of this fraction of half the write cache: small enough
# that the last chunk, flushed while nothing else runs, is short.
REPLAY_FLUSH_CHUNKS = 4


@dataclass(slots=True)
class _ReplayChunk:
    """A chunk of the write cache that replay handed to its flush thread."""

    frozen: WriteCache
    metas: list[LedgerMeta]
    future: Future[None]


class Replayer:
    """One replay: ``run`` once, on a thread, before the node serves."""

    def __init__(
        self,
        wal: Wal,
        index: Index,
        table: LedgerTable,
        caches: WriteCaches,
        lac: LacTracker,
        checkpoints: Checkpointer,
        stats: Stats,
        clock: Clock,
        flush_at: int,
    ) -> None:
        self._wal = wal
        self._index = index
        self._table = table
        self._caches = caches
        self._lac = lac
        self._checkpoints = checkpoints
        self._stats = stats
        self._clock = clock
        self._chunk = max(1, flush_at // REPLAY_FLUSH_CHUNKS)  # write cache bytes per flush

    def run(self) -> LogMark:
        """Load the table, replay the WAL from its last mark (returned), flushing as it goes."""
        table, index = self._table, self._index
        table.metas = index.load_ledgers()
        for meta in table.metas.values():
            # A replicated ledger's stripe has no local LAC to rebuild (its LAC is the
            # writer's, kept in the metadata: after a crash, as of the last checkpoint).
            if (
                meta.state != LedgerState.DELETED
                and meta.last_entry_id > meta.lac
                and meta.replication is None
            ):
                for entry_id in index.entry_ids(meta.ledger_id, meta.lac + 1):
                    self._lac.on_durable(meta, entry_id)
        mark = self._wal.last_mark()
        flushing: _ReplayChunk | None = None
        flush_as_we_go = True
        with ThreadPoolExecutor(1, thread_name_prefix="replay-flush") as flusher:
            for record, crc in self._wal.replay(mark):
                if isinstance(record, EntryRun):
                    self._replay_batch(record)
                else:
                    self._stats.replayed_records += 1
                    self._replay(record, crc)
                if flush_as_we_go and self._caches.current.size >= self._chunk:
                    if flushing is not None:
                        flush_as_we_go = self._flushed(flushing)
                    flushing = self._flush(flusher) if flush_as_we_go else None
            if flushing is not None:
                self._flushed(flushing)
        # The fleet's ids of replicated ledgers (from 2^62) never move the node's own.
        local = (lid for lid, meta in table.metas.items() if meta.replication is None)
        table.next_ledger_id = max(max(local, default=-1) + 1, index.next_ledger_id())
        log.info(
            "recovered %d ledgers, replayed %d WAL records from %s",
            len(table.metas),
            self._stats.replayed_records,
            mark,
        )
        return mark

    def _flush(self, flusher: ThreadPoolExecutor) -> _ReplayChunk:
        """Hand the write cache to ``flusher`` (without a mark: replay is not over); the
        frozen cache stays where replay looks for entries it may meet again."""
        frozen = self._caches.freeze()
        metas = self._table.snapshot_dirty()
        deleted = self._table.deleted_ids()
        future = flusher.submit(self._checkpoints.flush, frozen, metas, deleted, None)
        return _ReplayChunk(frozen, metas, future)

    def _flushed(self, chunk: _ReplayChunk) -> bool:
        """Wait for a chunk's flush; False if the disk was too full for it. Then its
        entries go back into the write cache (the journal since the mark, which a disk this
        full keeps small) and the node starts read-only."""
        try:
            chunk.future.result()
        except OSError as e:
            if not is_no_space(e):
                raise
            log.error("replay cannot flush for want of space (%s)", e)
            self._caches.put_back(chunk.frozen)  # an entry replayed again since is newer
            self._table.dirty.update(m.ledger_id for m in chunk.metas)
            return False
        finally:
            self._caches.flushed()
        return True

    def _replays_entries(self, meta: LedgerMeta) -> bool:
        """Whether replay puts the ledger's entries back (not a deleted ledger's, nor those
        of one whose entries live in the object store now)."""
        if meta.state == LedgerState.DELETED:
            return False
        return meta.offload is None or not meta.offload.local_deleted

    def _replay_batch(self, batch: EntryRun) -> None:
        """A batch record or a run: put back as one batch when its entries are fresh (at the
        ids after the ledger's last one), else record by record."""
        payloads = batch.payloads
        self._stats.replayed_records += len(payloads)
        meta = self._table.metas.get(batch.ledger_id)
        first = batch.first_entry_id
        if (
            meta is not None
            and payloads
            and first == meta.last_entry_id + 1
            and self._replays_entries(meta)
        ):
            last = first + len(payloads) - 1
            self._caches.current.put_batch(meta.ledger_id, first, batch.crcs, payloads)
            count_added(meta, self._stats, last, len(payloads), sum(map(len, payloads)))
            self._table.dirty.add(meta.ledger_id)
            if meta.replication is None:
                self._lac.on_durable_range(meta, first, last)
            return
        for record, crc in zip(batch.records(), batch.crcs, strict=True):
            self._replay(record, crc)

    def _replay(self, record: WalRecord, crc: int | None) -> None:
        ledger_id, entry_id, payload = record
        table = self._table
        meta = table.metas.get(ledger_id)
        if entry_id == LEDGER_CREATED:
            if meta is None:
                table.metas[ledger_id] = LedgerMeta.decode(ledger_id, payload)
                table.dirty.add(ledger_id)
            return
        if meta is None or meta.state == LedgerState.DELETED:
            return  # deleted since (or its creation was lost with a torn tail)
        if entry_id >= 0 and meta.offload is not None and meta.offload.local_deleted:
            return  # its entries live in the object store now: never back into the logs
        table.dirty.add(ledger_id)
        if entry_id >= 0:
            known = entry_id <= meta.last_entry_id and (
                self._caches.get(ledger_id, entry_id) is not None
                or self._index.get_location(ledger_id, entry_id) is not None
            )
            if not known:
                if crc is None:
                    crc = record_crc(ledger_id, entry_id, payload)
                self._caches.current.put(ledger_id, entry_id, crc, bytes(payload))
                count_added(meta, self._stats, entry_id, 1, len(payload))
            if meta.replication is None:
                self._lac.on_durable(meta, entry_id)
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
