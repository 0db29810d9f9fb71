"""A ledger's state transitions: create (OPEN), fence (FENCED), close (CLOSED), delete
(DELETED), and the explicit LAC.

Each is journaled in the WAL before it is acknowledged, as adds are. When the WAL refuses
one for want of space (``DiskFull``, ``Backpressure``), nothing of it is in the WAL and a
crash would undo it, so memory must not keep it as done:

- a creation is forgotten (a retry creates the ledger again);
- a deletion is undone (the ledger is back, its durable ids past the LAC too);
- a fence or close stays in memory (stricter: adds stay refused) but is remembered as
  ``unjournaled``, so that a retry journals it again instead of answering at once.

A replicated ledger (its writer a client of the fleet, node/client) is created here by its
first replica add or by a fencing read (``open_replica``): the creation is journaled before
any of its entries, and adds racing it wait for the same creation. A fencing read of a
ledger this node never saw creates it fenced (BookKeeper BP-46: a wiped or late replica
must not let an old writer in). Closing one is the metadata store's business: refused here.

Fencing or closing answers the ledger's LAC long polls (no add moves its LAC any more);
a fence that finds the ledger sealed already still waits for the adds in flight to settle
(a WAL sync point) before it reads the LAC, which is BookKeeper's fence read.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Awaitable, Callable

from node.storage.clock import Clock
from node.storage.descriptor import LedgerTable, check_replica, check_token, token_digest
from node.storage.errors import (
    Backpressure,
    DiskFull,
    InvalidArgument,
    LedgerExists,
    ReplicatedLedger,
)
from node.storage.index import MAX_ID, UNKNOWN_REPLICATION, LedgerMeta, LedgerState
from node.storage.lac import LacTracker
from node.storage.wal import CLOSE, DELETE, EXPLICIT_LAC, FENCE, LEDGER_CREATED, Wal, record_crc

log = logging.getLogger(__name__)

I64 = struct.Struct(">q")

DeletionListener = Callable[[LedgerMeta], Awaitable[None]]


class LedgerTransitions:
    """Journaled changes of ledger metadata; on the event loop."""

    def __init__(self, wal: Wal, table: LedgerTable, lac: LacTracker, clock: Clock) -> None:
        self._wal = wal
        self._table = table
        self._lac = lac
        self._clock = clock
        # Ledgers whose fence or close the WAL refused for want of space: in memory only.
        self._unjournaled: set[int] = set()
        self.deletion_listeners: list[DeletionListener] = []  # run after each deletion
        # Replicated ledgers whose creation is in the WAL's queue: who finds one waits for
        # it (its entries must not be acknowledged before the ledger is durable).
        self._creating: dict[int, asyncio.Future[None]] = {}

    async def create(
        self, ledger_id: int | None, properties: dict[str, str] | None, write_token: str | None
    ) -> tuple[LedgerMeta, bool]:
        """Create a ledger (node-allocated id when None). Returns (metadata, created):
        creating an existing open ledger with the same id again is a no-op."""
        table = self._table
        if ledger_id is None:
            ledger_id = table.allocate_id()
        elif not 0 <= ledger_id <= MAX_ID:
            raise InvalidArgument(f"ledger id {ledger_id} is outside [0, 2^63)")
        existing = table.metas.get(ledger_id)
        if existing is not None:
            if existing.state == LedgerState.DELETED:
                raise LedgerExists(f"ledger {ledger_id} was deleted; its id is not reusable")
            if (
                (properties or {}) != existing.properties
                or token_digest(write_token) != existing.token_digest
                or existing.replication is not None
            ):
                raise LedgerExists(f"ledger {ledger_id} exists with other properties or token")
            return existing, False
        meta = LedgerMeta(
            ledger_id,
            created_ms=self._clock.now_ms(),
            token_digest=token_digest(write_token),
            properties=dict(properties or {}),
        )
        table.adopt(meta)
        try:
            await self._journal(ledger_id, LEDGER_CREATED, meta.encode())
        except (DiskFull, Backpressure):  # the WAL refused it: not written
            # Not in the WAL: forget the ledger. Kept, a retry would find it and answer at
            # once, and a crash before the next checkpoint would lose it, and with it every
            # entry acknowledged to it since (replay drops entries of unknown ledgers).
            table.forget(meta)
            raise
        return meta, True

    async def open_replica(
        self, ledger_id: int, replication: tuple[int, int, int], fenced: bool = False
    ) -> tuple[LedgerMeta, bool]:
        """The replicated ledger, created (OPEN, or FENCED for a fencing read) and journaled
        if the node does not know it; (metadata, created). Whoever comes while a creation is
        in the WAL's queue waits for it, and fails with it. Deleted: ``LedgerNotFound``."""
        table = self._table
        meta = table.metas.get(ledger_id)
        if meta is not None:
            creating = self._creating.get(ledger_id)
            if creating is not None:
                await asyncio.shield(creating)
            meta = table.ledger(ledger_id)
            check_replica(table, meta, replication)
            return meta, False
        if not 0 <= ledger_id <= MAX_ID:
            raise InvalidArgument(f"ledger id {ledger_id} is outside [0, 2^63)")
        meta = LedgerMeta(
            ledger_id,
            state=LedgerState.FENCED if fenced else LedgerState.OPEN,
            created_ms=self._clock.now_ms(),
            replication=replication,
        )
        table.adopt(meta)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # Read by the waiters if any; retrieved here so that none need be.
        done.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._creating[ledger_id] = done
        try:
            await self._journal(ledger_id, LEDGER_CREATED, meta.encode())
        except (DiskFull, Backpressure) as error:
            table.forget(meta)  # not in the WAL (see ``create``)
            done.set_exception(error)
            raise
        except BaseException:
            # Cancelled (or the WAL failed for good): the record is queued or the WAL takes
            # nothing more; the waiters' own appends come after it and share its fate.
            done.set_result(None)
            raise
        finally:
            del self._creating[ledger_id]
        done.set_result(None)
        return meta, True

    def creating(self, ledger_id: int) -> bool:
        """Whether the replicated ledger's creation is still in the WAL's queue."""
        return ledger_id in self._creating

    async def fence_replica(
        self, ledger_id: int, replication: tuple[int, int, int] | None
    ) -> LedgerMeta:
        """A fencing read of a replicated ledger: journaled and durable before this returns
        (every add appended before it is then durable too; none is taken after it), the
        ledger created FENCED when the node does not know it."""
        meta, created = await self.open_replica(
            ledger_id, replication or UNKNOWN_REPLICATION, fenced=True
        )
        if not created:
            await self.fence(ledger_id, None)
        return meta

    async def fence(self, ledger_id: int, write_token: str | None) -> int:
        """No add succeeds after this returns; returns the LAC (BookKeeper's fence read).
        A ledger's write token is asked for as for adds (BookKeeper's master key)."""
        meta = self._table.ledger(ledger_id)
        check_token(meta, write_token)
        try:
            if meta.state == LedgerState.OPEN:
                meta.state = LedgerState.FENCED
                self._table.dirty.add(ledger_id)
                await self._journal_state(meta)
            elif ledger_id in self._unjournaled:
                await self._journal_state(meta)
            else:
                await self._wal.sync_point()  # in-flight adds settle before the LAC is read
        finally:
            self._lac.sealed(meta)
        return meta.lac

    async def close(self, ledger_id: int, write_token: str | None) -> LedgerMeta:
        """Seal the ledger: its last entry is fixed (adds in flight finish first)."""
        meta = self._table.ledger(ledger_id)
        if meta.replication is not None:
            raise ReplicatedLedger(
                f"ledger {ledger_id} is replicated: its writer closes it in the metadata store"
            )
        check_token(meta, write_token)
        try:
            if meta.state != LedgerState.CLOSED:
                meta.state = LedgerState.CLOSED
                meta.closed_ms = self._clock.now_ms()
                self._table.dirty.add(ledger_id)
                await self._journal_state(meta)
            elif ledger_id in self._unjournaled:
                await self._journal_state(meta)
            else:
                await self._wal.sync_point()
        finally:
            self._lac.sealed(meta)
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

    async def delete(self, ledger_id: int, write_token: str | None) -> None:
        """Entries become unreadable at once; GC reclaims their space later."""
        table = self._table
        meta = table.ledger(ledger_id)
        check_token(meta, write_token)
        before = meta.state
        meta.state = LedgerState.DELETED
        table.dirty.add(ledger_id)
        above = self._lac.deleted(ledger_id)
        table.deleting.add(ledger_id)  # not purged before the WAL holds the deletion
        try:
            await self._journal(ledger_id, DELETE, b"")
        except (DiskFull, Backpressure):
            # Not in the WAL: the ledger is back, rather than gone until a crash brings it
            # back (the client retries the delete once there is space). Dirty again: a
            # checkpoint meanwhile may have written the deletion to the index.
            if meta.state == LedgerState.DELETED and table.metas.get(ledger_id) is meta:
                meta.state = before
                table.dirty.add(ledger_id)
                for entry_id in sorted(above):
                    self._lac.on_durable(meta, entry_id)
            raise
        finally:
            table.deleting.discard(ledger_id)
        for listener in self.deletion_listeners:
            try:
                await listener(meta)
            except Exception:
                # The ledger is deleted; what the listener left (offloaded objects) stays
                # recorded with the tombstone, and its owner retries (purge waits for it).
                log.exception("a deletion listener failed for ledger %d", ledger_id)

    async def set_explicit_lac(self, ledger_id: int, lac: int) -> int:
        """Raise the LAC to ``lac`` (never lowers it); entries up to it must be durable."""
        meta = self._table.ledger(ledger_id)
        if lac > meta.last_entry_id:
            raise InvalidArgument(f"LAC {lac} is past the last entry {meta.last_entry_id}")
        await self._journal(ledger_id, EXPLICIT_LAC, I64.pack(lac))
        if lac > meta.lac:
            meta.lac = lac
            self._table.dirty.add(ledger_id)
            self._lac.wake(meta)
        return meta.lac

    async def _journal(self, ledger_id: int, kind: int, payload: bytes) -> None:
        await self._wal.append(ledger_id, kind, record_crc(ledger_id, kind, payload), payload)
