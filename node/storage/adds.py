"""The add path (BookKeeper's LedgerDescriptor.addEntry and DbLedgerStorage.addEntry).

Add: validate -> write cache -> WAL append -> await the group fsync -> advance the LAC.
The cache put and the WAL append happen in one synchronous step on the event loop, so a
checkpoint's swap (also synchronous) never splits them; the entry is counted into its
ledger (last entry id, counts) in that step too, so the next add takes the next id at
once. An add is acknowledged only when the WAL group holding it is durable; its LAC
moves then (``lac``). Appends that end otherwise are settled by ``settle``.

Back-pressure: an add that finds the write cache half full asks for a checkpoint, and
waits for the flush running (``Checkpointer.throttle``) before it adds to the cache.

Replica adds (a replicated ledger's writer, node/client, sends each entry to the
replicas of its write set): entries at the ids the writer chose, the ledger created on the
first (journaled before the entry), idempotent for identical bytes, no LAC bookkeeping
(this node holds a stripe, never a prefix: the ledger's LAC is the writer's, carried by
each add); acknowledged, as every add, once the WAL holds them durably. A fenced ledger
takes only a recovery's re-adds.

This is the hot path (tens of thousands of adds a second on one loop): the common case of
each check comes first, in one test, and no call is made that the case does not need.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
from dataclasses import dataclass

from node.storage.cache import WriteCaches
from node.storage.checkpoint import Checkpointer
from node.storage.descriptor import (
    LedgerTable,
    check_ids_left,
    check_open,
    check_replica,
    check_token,
    count_added,
)
from node.storage.errors import (
    Backpressure,
    DiskFull,
    EntryConflict,
    EntryTooLarge,
    InvalidArgument,
    ReplicatedLedger,
)
from node.storage.index import MAX_ID, LedgerMeta, LedgerState
from node.storage.lac import LacTracker
from node.storage.probe import Stats
from node.storage.readonly import ReadOnlyState
from node.storage.reads import EntryReads
from node.storage.settle import Appended, AppendSettler
from node.storage.transitions import LedgerTransitions
from node.storage.wal import LogMark, Wal, record_crc

_OPEN = LedgerState.OPEN  # tested per add: a module name is cheaper than an enum attribute


@dataclass(slots=True)
class PendingAdd:
    """An add that ``begin_add`` queued, until its WAL write is done (``future``)."""

    meta: LedgerMeta
    entry_id: int
    payload: bytes
    future: asyncio.Future[LogMark]
    floor: int = -1  # a replica add's: the highest id the ledger held before it


@dataclass(slots=True, frozen=True)
class ReplicaAdd:
    """What a replica add says besides its entries (the bookie protocol's headers)."""

    replication: tuple[int, int, int]  # E/Qw/Qa (X-Replicated)
    lac: int  # the writer's LAC when it sent the add (X-Lac)
    lac_length: int = 0  # the ledger's bytes up to that LAC (X-Lac-Length)
    recovery: bool = False  # a recovery's re-add: taken on a fenced ledger (X-Recovery-Add)


class AddPath:
    """Adds of entries; on the event loop."""

    def __init__(
        self,
        table: LedgerTable,
        caches: WriteCaches,
        lac: LacTracker,
        wal: Wal,
        read_only: ReadOnlyState,
        checkpoints: Checkpointer,
        reads: EntryReads,
        stats: Stats,
        max_entry_size: int,
        flush_at: int,
        transitions: LedgerTransitions,
    ) -> None:
        self._table = table
        self._transitions = transitions
        self._caches = caches
        self._lac = lac
        self._wal = wal
        self._read_only = read_only
        self._checkpoints = checkpoints
        self._reads = reads
        self._stats = stats
        self._settle = AppendSettler(table, caches, lac)
        self._max_entry_size = max_entry_size
        self._flush_at = flush_at  # write cache bytes that ask for a checkpoint

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
        if self._caches.current.size >= self._flush_at:
            await self._throttle()
        meta = self._writable(ledger_id, write_token)
        if entry_id is None:
            check_ids_left(meta, 1)
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
            self._settle.failed(meta, future, error, lambda: [(entry_id, payload, future)])
            raise
        self._lac.on_durable(meta, entry_id)
        return entry_id

    def begin_add(
        self, ledger_id: int, payload: bytes, write_token: str | None = None
    ) -> PendingAdd | None:
        """``add_entry`` at the next id without a coroutine, for the HTTP fast lane: the add
        as far as it goes without waiting (checked, cached, queued in the WAL), or None
        when it would have to wait for the write cache (then ``add_entry`` does it). Once
        the add's future is done, ``finish_add`` settles it."""
        self._check_size(len(payload))
        if self._caches.current.size >= self._flush_at:
            return None
        meta = self._writable(ledger_id, write_token)
        check_ids_left(meta, 1)
        entry_id = meta.last_entry_id + 1
        return PendingAdd(meta, entry_id, payload, self._append_now(meta, entry_id, payload))

    def finish_add(self, add: PendingAdd) -> int:
        """The entry id of a ``begin_add`` whose future is done, now counted toward the LAC;
        or its error, the refused entry forgotten as ``add_entry`` forgets it. No caller can
        give up in between (nothing awaits), so the entry always settles here."""
        error = add.future.exception()
        if error is not None:
            if isinstance(error, DiskFull | Backpressure):
                self._settle.refused(add.meta, [(add.entry_id, add.payload, add.future)])
            raise error
        self._lac.on_durable(add.meta, add.entry_id)
        return add.entry_id

    async def add_entries(
        self, ledger_id: int, payloads: list[bytes], write_token: str | None = None
    ) -> list[int]:
        """Append a batch at the next ids; one durable acknowledgment for all of them."""
        for payload in payloads:
            self._check_size(len(payload))
        if self._caches.current.size >= self._flush_at:
            await self._throttle()
        meta = self._writable(ledger_id, write_token)
        # Before the first append: a batch is acknowledged or refused whole, never cut
        # in two with its head journaled.
        check_ids_left(meta, len(payloads))
        first = meta.last_entry_id + 1
        ids = list(range(first, first + len(payloads)))
        if not payloads:
            return ids
        # The batch is the unit of work: one cache update, one journal part, one count and
        # one LAC step, instead of a pass through the single-entry path per entry.
        ledger_id = meta.ledger_id
        crcs = [record_crc(ledger_id, eid, p) for eid, p in zip(ids, payloads, strict=True)]
        self._caches.current.put_batch(ledger_id, first, crcs, payloads)
        count_added(meta, self._stats, ids[-1], len(payloads), sum(map(len, payloads)))
        self._table.dirty.add(ledger_id)
        future = self._wal.append_batch(ledger_id, first, crcs, payloads)
        if self._caches.current.size >= self._flush_at:
            self._checkpoints.want()
        try:
            await future
        except BaseException as error:
            self._settle.failed(
                meta,
                future,
                error,
                lambda: [(eid, p, future) for eid, p in zip(ids, payloads, strict=True)],
            )
            raise
        self._lac.on_durable_range(meta, first, ids[-1])
        return ids

    # --- replica adds ------------------------------------------------------------------------

    def begin_replica_add(
        self, ledger_id: int, entry_id: int, payload: bytes, replica: ReplicaAdd
    ) -> PendingAdd | None:
        """``begin_add`` of a replica add of one entry at a fresh id of a ledger the node
        knows; None for anything else (``add_replica`` does it then)."""
        self._check_size(len(payload))
        if self._caches.current.size >= self._flush_at:
            return None
        meta = self._table.metas.get(ledger_id)
        if meta is None or entry_id <= meta.last_entry_id or self._transitions.creating(ledger_id):
            return None
        self._replica_writable(meta, replica)
        floor = meta.last_entry_id
        future = self._append_now(meta, entry_id, payload)
        return PendingAdd(meta, entry_id, payload, future, floor)

    def finish_replica_add(self, add: PendingAdd) -> int:
        """``finish_add`` of a ``begin_replica_add``: no LAC to move."""
        error = add.future.exception()
        if error is not None:
            if isinstance(error, DiskFull | Backpressure):
                self._settle.refused(add.meta, [(add.entry_id, add.payload, add.future)])
                _keep_floor(add.meta, add.floor)
            raise error
        return add.entry_id

    async def add_replica(
        self, ledger_id: int, entries: list[tuple[int, bytes]], replica: ReplicaAdd
    ) -> LedgerMeta:
        """Add entries at the writer's ids (ascending) to a replicated ledger, creating it
        here on its first add; returns its metadata once every entry is durable. An id held
        already with identical bytes is a no-op (a resend), other bytes conflict."""
        ids = [entry_id for entry_id, _payload in entries]
        if ids[0] < 0 or ids[-1] > MAX_ID or any(b <= a for a, b in itertools.pairwise(ids)):
            raise InvalidArgument("replica entry ids must ascend, within [0, 2^63)")
        for _entry_id, payload in entries:
            self._check_size(len(payload))
        if self._caches.current.size >= self._flush_at:
            await self._throttle()
        self._read_only.check()  # before a creation that no entry could follow
        meta, _created = await self._transitions.open_replica(ledger_id, replica.replication)
        self._replica_writable(meta, replica)
        # Fresh ids (past the highest held) are appended at once, in one synchronous step;
        # the others are looked up first (a resend, or a recovery's re-add).
        floor = meta.last_entry_id
        split = bisect.bisect_right(ids, floor)
        appended = self._append_fresh(meta, entries[split:])
        resent = False
        try:
            for entry_id, payload in entries[:split]:
                future = await self._replica_again(meta, entry_id, payload, replica)
                if future is None:
                    resent = True
                else:
                    appended.append((entry_id, payload, future))
        except BaseException:
            if appended:  # they land or are refused without us: settle them then
                self._settle.failed(
                    meta, appended[-1][2], asyncio.CancelledError(), lambda: appended
                )
            raise
        for _entry_id, _payload, future in appended:
            try:
                await future
            except BaseException as error:
                self._settle.failed(meta, appended[-1][2], error, lambda: appended)
                _keep_floor(meta, floor)
                raise
        if resent:
            await self._wal.sync_point()  # what the first send appended is durable now
        return meta

    def _append_fresh(self, meta: LedgerMeta, entries: list[tuple[int, bytes]]) -> Appended:
        """Append entries past the ledger's last id: consecutive ones as one batch."""
        if not entries:
            return []
        first = entries[0][0]
        if len(entries) == 1 or entries[-1][0] - first != len(entries) - 1:
            return [(eid, p, self._append_now(meta, eid, p)) for eid, p in entries]
        ledger_id = meta.ledger_id
        payloads = [p for _eid, p in entries]
        crcs = [record_crc(ledger_id, eid, p) for eid, p in entries]
        self._caches.current.put_batch(ledger_id, first, crcs, payloads)
        count_added(meta, self._stats, entries[-1][0], len(payloads), sum(map(len, payloads)))
        self._table.dirty.add(ledger_id)
        future = self._wal.append_batch(ledger_id, first, crcs, payloads)
        if self._caches.current.size >= self._flush_at:
            self._checkpoints.want()
        return [(eid, p, future) for eid, p in entries]

    async def _replica_again(
        self, meta: LedgerMeta, entry_id: int, payload: bytes, replica: ReplicaAdd
    ) -> asyncio.Future[LogMark] | None:
        """An id at or below the highest held: its append, or None when the same bytes are
        there already; ``EntryConflict`` for other bytes."""
        caches = self._caches
        existing = caches.get(meta.ledger_id, entry_id)
        if existing is None:
            existing = await self._reads.stored(meta.ledger_id, entry_id)
        if existing is None:
            meta = self._table.ledger(meta.ledger_id)  # re-checked after the await
            self._replica_writable(meta, replica)
            existing = caches.get(meta.ledger_id, entry_id)
            if existing is None:
                return self._append_now(meta, entry_id, payload)
        if existing != payload:
            raise EntryConflict(
                f"entry {entry_id} of ledger {meta.ledger_id} exists with different bytes"
            )
        return None

    def _replica_writable(self, meta: LedgerMeta, replica: ReplicaAdd) -> None:
        """A replica add may go to the ledger (replicated, open or a recovery's re-add to a
        fenced one, the node writable); the writer's LAC it carries is kept."""
        check_replica(self._table, meta, replica.replication)
        if meta.state == LedgerState.DELETED:
            self._table.ledger(meta.ledger_id)  # LedgerNotFound
        check_open(meta, replica.recovery)
        self._read_only.check()
        meta.replica_adds += 1  # a resend of bytes held too: its sender may name us next
        if replica.lac > meta.writer_lac:
            # The writer's claim holds whatever this replica holds: Qa replicas acked it.
            meta.writer_lac = replica.lac
            meta.writer_lac_length = replica.lac_length
            self._table.dirty.add(meta.ledger_id)

    def _append_now(
        self, meta: LedgerMeta, entry_id: int, payload: bytes
    ) -> asyncio.Future[LogMark]:
        ledger_id = meta.ledger_id
        crc = record_crc(ledger_id, entry_id, payload)
        cache = self._caches.current
        cache.put(ledger_id, entry_id, crc, payload)
        future = self._wal.append(ledger_id, entry_id, crc, payload)
        count_added(meta, self._stats, entry_id, 1, len(payload))
        self._table.dirty.add(ledger_id)
        if cache.size >= self._flush_at:
            self._checkpoints.want()
        return future

    async def _add_again(
        self, meta: LedgerMeta, entry_id: int, payload: bytes, write_token: str | None
    ) -> None:
        """An id at or below the last one: a retry (identical bytes), a conflict, or the
        filling of a hole."""
        caches = self._caches
        existing = caches.get(meta.ledger_id, entry_id)
        if existing is None:
            existing = await self._reads.stored(meta.ledger_id, entry_id)
        if existing is None:
            meta = self._writable(meta.ledger_id, write_token)  # re-checked after the await
            if caches.get(meta.ledger_id, entry_id) is None:
                future = self._append_now(meta, entry_id, payload)
                try:
                    await future
                except BaseException as error:
                    self._settle.failed(meta, future, error, lambda: [(entry_id, payload, future)])
                    raise
                self._lac.on_durable(meta, entry_id)
                return
            existing = caches.get(meta.ledger_id, entry_id)
        if existing != payload:
            raise EntryConflict(
                f"entry {entry_id} of ledger {meta.ledger_id} exists with different bytes"
            )
        if not self._lac.is_durable(meta, entry_id):
            await self._wal.sync_point()

    async def _throttle(self) -> None:
        self._read_only.check_running()
        await self._checkpoints.throttle()

    def _check_size(self, size: int) -> None:
        if size > self._max_entry_size:
            raise EntryTooLarge(
                f"entry of {size} bytes exceeds max_entry_size {self._max_entry_size}"
            )

    def _writable(self, ledger_id: int, write_token: str | None) -> LedgerMeta:
        meta = self._table.metas.get(ledger_id)
        # Every add passes here: the common case (running, writable, an open ledger without
        # a token) in one test, the checks below in their order for the rest.
        if (
            meta is not None
            and meta.state is _OPEN
            and not meta.token_digest
            and meta.replication is None
            and self._read_only.writable
        ):
            return meta
        self._read_only.check()
        meta = self._table.ledger(ledger_id)
        if meta.replication is not None:
            raise ReplicatedLedger(
                f"ledger {ledger_id} is replicated: its writer adds to it (X-Replicated)"
            )
        check_open(meta)
        check_token(meta, write_token)
        return meta


def _keep_floor(meta: LedgerMeta, floor: int) -> None:
    """After the WAL refused a replica add: the settler recounts the last id from the local
    LAC and the write cache, which a replica's stripe is not (its entries checkpointed
    since are in neither). The ids held before the add stay counted, or a later add at one
    of them would be taken for a fresh id and appended without the check for other bytes."""
    if meta.last_entry_id < floor:
        meta.last_entry_id = floor
