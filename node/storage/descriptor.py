"""What the node knows of each ledger, in memory (BookKeeper's LedgerDescriptor and
HandleFactory): the ledger table and the checks an add passes.

``LedgerTable`` maps ledger ids to their ``LedgerMeta`` (state, LAC, last entry id, counts,
write-token digest, offload record), the one copy every part of the engine reads and
changes on the event loop. It also keeps which ledgers changed since the last checkpoint
(``dirty``: the checkpoint writes their metadata to the index), which deletions wait for
the WAL, and the next ledger id to hand out.

Who may change a ledger: a ledger created with a write token changes only for a holder of
it (``check_token``: BookKeeper's master key); adds go only to an open ledger
(``check_open``: a fenced or closed ledger refuses them) and below the last entry id
(``check_ids_left``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
from collections.abc import Iterable

from node.storage.errors import (
    LedgerClosed,
    LedgerFenced,
    LedgerFull,
    LedgerNotFound,
    NotReplicated,
    WriteTokenMismatch,
)
from node.storage.index import MAX_ID, UNKNOWN_REPLICATION, LedgerMeta, LedgerState
from node.storage.probe import Stats


class LedgerTable:
    """Ledger metadata by id; lives on the event loop (``is_live`` excepted)."""

    __slots__ = ("deleting", "dirty", "metas", "next_ledger_id")

    def __init__(self) -> None:
        self.metas: dict[int, LedgerMeta] = {}  # deleted ones too, until GC purges them
        self.dirty: set[int] = set()  # ledgers whose metadata changed since the last swap
        self.deleting: set[int] = set()  # deletions waiting for the WAL: not to be purged
        self.next_ledger_id = 0

    def ledger(self, ledger_id: int) -> LedgerMeta:
        """A ledger that exists (not deleted), else ``LedgerNotFound``."""
        meta = self.metas.get(ledger_id)
        if meta is None or meta.state == LedgerState.DELETED:
            raise LedgerNotFound(f"ledger {ledger_id} does not exist")
        return meta

    def ledgers(self) -> Iterable[LedgerMeta]:
        return (m for m in self.metas.values() if m.state != LedgerState.DELETED)

    def adopt(self, meta: LedgerMeta) -> None:
        """A ledger new to the node (created, or replayed from the WAL)."""
        self.metas[meta.ledger_id] = meta
        if meta.replication is None:  # the fleet's ids (from 2^62) never move the node's
            self.next_ledger_id = max(self.next_ledger_id, meta.ledger_id + 1)
        self.dirty.add(meta.ledger_id)

    def forget(self, meta: LedgerMeta) -> None:
        """Undo ``adopt`` (the WAL refused the creation), unless the id was taken since."""
        if self.metas.get(meta.ledger_id) is meta:
            del self.metas[meta.ledger_id]
            self.dirty.discard(meta.ledger_id)

    def allocate_id(self) -> int:
        """One past the highest id in use; once a client has taken the highest possible
        id, the lowest free one (ids of deleted ledgers stay taken until GC)."""
        if self.next_ledger_id <= MAX_ID:
            return self.next_ledger_id
        ledger_id = 0
        while ledger_id in self.metas:
            ledger_id += 1
        return ledger_id

    def is_live(self, ledger_id: int) -> bool:
        """Known to the node (a deleted ledger counts until its index entries are purged,
        so compaction never leaves an index entry pointing at nothing), unless its local
        copy was dropped after an offload (its index entries went in the same batch).
        Thread safe."""
        meta = self.metas.get(ledger_id)
        return meta is not None and not (meta.offload is not None and meta.offload.local_deleted)

    def deleted_ids(self) -> frozenset[int]:
        return frozenset(lid for lid, m in self.metas.items() if m.state == LedgerState.DELETED)

    def snapshot_dirty(self) -> list[LedgerMeta]:
        """Copies of the dirty ledgers' metadata, for a checkpoint to write; clears ``dirty``."""
        # A dirty id may name a ledger forgotten since (its creation refused by the WAL):
        # nothing of it is to be written. Raising here would strand the swapped cache.
        metas = [dataclasses.replace(m) for lid in self.dirty if (m := self.metas.get(lid))]
        self.dirty.clear()
        return metas


def count_added(meta: LedgerMeta, stats: Stats, last_entry_id: int, count: int, size: int) -> None:
    """Count ``count`` entries of ``size`` payload bytes, ending at ``last_entry_id``, into
    the ledger and the engine's stats (an add, a batch, or what replay puts back)."""
    meta.entries += count
    meta.payload_bytes += size
    if last_entry_id > meta.last_entry_id:
        meta.last_entry_id = last_entry_id
    stats.adds += count
    stats.add_bytes += size


def token_digest(token: str | None) -> bytes:
    """What the metadata keeps of a write token (never the token itself). A header that is
    not UTF-8 arrives with surrogates for its bytes: the token is those bytes."""
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest() if token else b""


def check_token(meta: LedgerMeta, write_token: str | None) -> None:
    """A ledger created with a write token changes only for a holder of it."""
    if meta.token_digest and not hmac.compare_digest(meta.token_digest, token_digest(write_token)):
        raise WriteTokenMismatch(f"wrong or missing write token for ledger {meta.ledger_id}")


def check_ids_left(meta: LedgerMeta, count: int) -> None:
    """Room for ``count`` more entries at the next ids (they end at 2^63 - 1)."""
    if count > MAX_ID - meta.last_entry_id:
        raise LedgerFull(
            f"ledger {meta.ledger_id} has room for {MAX_ID - meta.last_entry_id} more "
            f"entries, not {count}: entry ids end at 2^63 - 1"
        )


def check_open(meta: LedgerMeta, recovery: bool = False) -> None:
    """Adds go only to an open ledger: fencing or closing it ends them. A recovery's re-add
    to a replicated ledger passes a fence (the recovery fenced it), never a close."""
    if meta.state == LedgerState.CLOSED:
        raise LedgerClosed(f"ledger {meta.ledger_id} is closed")
    if meta.state == LedgerState.FENCED and not recovery:
        raise LedgerFenced(f"ledger {meta.ledger_id} is fenced")


def check_replica(table: LedgerTable, meta: LedgerMeta, replication: tuple[int, int, int]) -> None:
    """A replica add or a fencing read finds a replicated ledger, never a local one. One a
    fencing read created learns its quorums from the first add that tells them."""
    if meta.replication is None:
        raise NotReplicated(
            f"ledger {meta.ledger_id} is a local ledger of this node, not a replica"
        )
    if meta.replication == UNKNOWN_REPLICATION and replication != UNKNOWN_REPLICATION:
        meta.replication = replication
        table.dirty.add(meta.ledger_id)
