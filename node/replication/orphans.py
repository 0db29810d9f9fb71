"""Replicas that no segment of their ledger names: what an interrupted re-replication leaves
(BookKeeper's over-replicated ledger GC, ``gcOverreplicatedLedgerWaitTime``).

A re-replication worker (node/autorecovery/worker.py) writes a fragment to its replacement with
recovery adds *before* it CAS-swaps the replacement into the segment. A worker killed between
the two, or one that loses the CAS or its lock, leaves the replacement holding a replica of a
ledger that exists but whose metadata never names this node; the deleted-ledger sweep
(node/replication/reconcile.py) never takes it. This pass, run by that sweep on each replica
whose ledger the store still has and whose segments do not name this node, deletes it when:

1. the replica took no replica add for ``replication_overreplicated_grace_s``, as this process
   saw it (the count kept in memory: after a restart the wait starts again);
2. read linearizably, in this order: no ``underreplicated-locks/<ledger>`` (a worker holds
   it from before its first add until after its CAS), the store is this node's cluster, and
   the ledger's metadata (read last) names this node in no segment;
3. the replica still took no add since the count was read in (1), tested in the same
   synchronous step that makes the delete take effect (``LedgerStorage.delete_quiet_replica``).

Why a worker copying meanwhile never loses the copy it then CASes in: if it held the lock when
the lock was read, the delete does not happen. If it took the lock after, each of its adds came
after the count of (1) was read: either before the delete's step (the count moved: kept) or
after it (refused, the ledger deleted here): its read-back fails and it never CASes. If it
released the lock before, its CAS came before the metadata read, which then names this node.
What remains is a worker that checked its lock, then stalled past the lock's lease, then CASes:
no fencing token guards a CAS sent late, so the grace is that bound. It is generous for this
reason (one day, BookKeeper's default: a stall or partition of a worker, or a writer's ensemble
change whose CAS lags its adds, is far shorter; an orphan's disk space waits a day, and orphans
are rare: one interrupted copy each). Any answer the store cannot give keeps the replica and
counts ``replication_gc_skipped``.

A reclaimed replica leaves its ledger's tombstone until the node's GC purges it; meanwhile a
worker that picks this node again for that ledger is refused (``ledger_not_found``) and its
marker waits for a later run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from node.client.model import MetadataFormatError, decode
from node.replication.reconcile import StoreGuard, names
from node.storage.errors import LedgerNotFound, StorageError

log = logging.getLogger(__name__)


class QuietReplicas(Protocol):
    def replica_adds(self, ledger_id: int) -> int: ...

    async def delete_quiet_replica(self, ledger_id: int, replica_adds: int) -> bool: ...


class OrphanReclaim:
    """The over-replicated pass; ``consider`` is asked by the sweep about each replica."""

    def __init__(
        self,
        storage: QuietReplicas,
        guard: StoreGuard,
        node_id: str,
        grace_s: float,
        now_ms: Callable[[], int],
        on_reclaim: Callable[[], None] = lambda: None,
        on_skip: Callable[[], None] = lambda: None,
    ) -> None:
        self._storage = storage
        self._guard = guard
        self._node_id = node_id
        self._grace_ms = grace_s * 1000
        self._now_ms = now_ms
        self._on_reclaim = on_reclaim
        self._on_skip = on_skip
        # ledger -> (replica adds counted, when this process first saw that count)
        self._quiet: dict[int, tuple[int, int]] = {}
        self.reclaimed = 0
        self.skipped = 0  # kept: unreadable metadata, or a delete the storage refused

    def track(self, ledger_ids: list[int]) -> None:
        """Note each held replica's add count (a new count starts its quiet time anew); forget
        the replicas no longer held. Once per sweep, before any ``consider``."""
        now = self._now_ms()
        quiet: dict[int, tuple[int, int]] = {}
        for ledger_id in ledger_ids:
            try:
                adds = self._storage.replica_adds(ledger_id)
            except LedgerNotFound:
                continue
            seen = self._quiet.get(ledger_id)
            quiet[ledger_id] = seen if seen is not None and seen[0] == adds else (adds, now)
        self._quiet = quiet

    async def consider(self, ledger_id: int, metadata: bytes) -> bool:
        """Delete the replica if it is an orphan (see the module's three conditions);
        ``metadata`` is the ledger's as the sweep just read it (a node it names is kept
        without asking more). MetadataError: the store could not say (counted); kept."""
        seen = self._quiet.get(ledger_id)
        if seen is None or self._now_ms() - seen[1] < self._grace_ms:
            return False
        try:
            if names(decode(metadata), self._node_id):
                return False
        except MetadataFormatError as error:
            self.skipped += 1
            self._on_skip()
            log.warning("replica GC keeps ledger %d: unreadable metadata: %s", ledger_id, error)
            return False
        try:
            adds = self._storage.replica_adds(ledger_id)
        except LedgerNotFound:
            return False
        if adds != seen[0]:
            return False  # an add since the sweep began: the next sweep starts its wait anew
        if not await self._guard.orphaned(ledger_id, self._node_id):
            return False
        try:
            deleted = await self._storage.delete_quiet_replica(ledger_id, adds)
        except LedgerNotFound:
            return False
        except StorageError as error:  # a full disk, a failed WAL: the next pass retries
            self.skipped += 1
            self._on_skip()
            log.warning("replica GC could not delete ledger %d: %s", ledger_id, error)
            return False
        if not deleted:
            log.info("replica GC keeps ledger %d: a replica add came while it asked", ledger_id)
            return False
        self.reclaimed += 1
        self._on_reclaim()
        log.info(
            "replica of ledger %d deleted: no segment names %s, no worker holds its lock, "
            "no add for %d s",
            ledger_id,
            self._node_id,
            self._grace_ms // 1000,
        )
        return True
