"""A ledger's state transitions: create (OPEN), fence (FENCED), close (CLOSED), delete
(DELETED), and the explicit LAC.

Each is journaled in the WAL before it is acknowledged, as adds are. When the WAL refuses
one for want of space (``DiskFull``, ``Backpressure``), nothing of it is in the WAL and a
crash would undo it, so memory must not keep it as done:

- a creation is forgotten (a retry creates the ledger again);
- a deletion is undone (the ledger is back, its durable ids past the LAC too);
- a fence or close stays in memory (stricter: adds stay refused) but is remembered as
  ``unjournaled``, so that a retry journals it again instead of answering at once.

Fencing or closing answers the ledger's LAC long polls (no add moves its LAC any more);
a fence that finds the ledger sealed already still waits for the adds in flight to settle
(a WAL sync point) before it reads the LAC, which is BookKeeper's fence read.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Awaitable, Callable

from node.storage.clock import Clock
from node.storage.descriptor import LedgerTable, check_token, token_digest
from node.storage.errors import Backpressure, DiskFull, InvalidArgument, LedgerExists
from node.storage.index import MAX_ID, LedgerMeta, LedgerState
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
            if (properties or {}) != existing.properties or token_digest(write_token) != (
                existing.token_digest
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
