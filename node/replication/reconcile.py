"""A replica is reclaimed only once the metadata store says its ledger is gone.

``ReplicaGuard.confirm_deleted`` (the HTTP delete of a replicated ledger asks it, and so does
the sweep) answers True only when a *linearizable* get of ``ledgers/<id>`` finds nothing and
the store's ``cluster`` key is this node's cookie's cluster: a node pointed at an empty or
another cluster's prefix would otherwise see every ledger as deleted (pulsar-helm-chart#16).
Errors raise ``MetadataError``: the caller keeps the replica.

The sweep runs every ``replication_gc_interval_s`` over the node's replicated ledgers; a
replica younger than ``replication_gc_grace_s`` is never looked at (a ledger being created is
written to its replicas before, or while, its metadata becomes visible to everyone). A
confirmed one gets the ordinary journaled delete; the existing GC reclaims its space later.
Any error or timeout keeps everything and counts ``replication_gc_skipped`` (the guard's
errors, whichever path asked, and deletes the storage refused). A replica of a ledger the store
still has goes to the over-replicated pass (node/replication/orphans.py), which deletes it only
if no segment names this node, under guards of its own.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

from node.autorecovery.markers import lock_key
from node.client.errors import ClientError, MetadataError
from node.client.metadata.store import MetadataStore
from node.client.model import CLUSTER_KEY, LedgerMetadata, MetadataFormatError, decode, ledger_key
from node.replication.tasks import cancel_and_wait
from node.storage.errors import LedgerNotFound, StorageError

log = logging.getLogger(__name__)
T = TypeVar("T")


class ReplicaStorage(Protocol):
    def replicated_ledgers(self) -> list[tuple[int, int]]:
        """(ledger id, created ms) of the replicated ledgers held here, not deleted."""

    async def delete_ledger(self, ledger_id: int, write_token: str | None = None) -> None: ...


class OverReplicated(Protocol):
    """What the sweep asks of the over-replicated pass (node/replication/orphans.py's
    ``OrphanReclaim``, which imports this module's guard)."""

    def track(self, ledger_ids: list[int]) -> None: ...

    async def consider(self, ledger_id: int, metadata: bytes) -> bool: ...


class StoreGuard:
    """The ReplicaGuard of a node with a metadata store."""

    def __init__(
        self,
        store: MetadataStore,
        cluster_id: Callable[[], str | None],
        timeout_s: float,
        on_error: Callable[[], None] = lambda: None,
    ) -> None:
        self._store = store
        self._cluster_id = cluster_id  # the cookie's, once the start checked it
        self._timeout_s = timeout_s
        self._on_error = on_error
        self.errors = 0  # answers it could not give: the replica was kept

    async def confirm_deleted(self, ledger_id: int) -> bool:
        return await self.lookup(ledger_id) is None

    async def lookup(self, ledger_id: int) -> bytes | None:
        """The ledger's metadata as the store holds it now (a linearizable read), or None
        only when it has none *and* is this node's cluster. MetadataError when it cannot say
        (unreachable, slow, another cluster): the caller keeps the replica."""
        return await self._ask(self._lookup(ledger_id))

    async def orphaned(self, ledger_id: int, node_id: str) -> bool:
        """True only when, read linearizably in this order, no worker holds the ledger's
        marker lock (a copy to this node may be in flight), the store is this node's cluster,
        and the ledger exists with no segment naming ``node_id``. The metadata is read last:
        nothing can have named the node between this answer and the caller's delete except a
        worker whose adds the caller's delete then refuses (node/replication/orphans.py)."""
        return await self._ask(self._orphaned(ledger_id, node_id))

    async def _ask(self, question: Awaitable[T]) -> T:
        try:
            async with asyncio.timeout(self._timeout_s):
                return await question
        except TimeoutError:
            error = MetadataError(f"the store did not answer in {self._timeout_s} s")
        except MetadataError as raised:
            error = raised
        except ClientError as raised:
            error = MetadataError(str(raised))
        self.errors += 1
        self._on_error()
        raise error

    def _mine(self) -> str:
        mine = self._cluster_id()
        if mine is None:
            raise MetadataError("this node's cookie is not checked yet")
        return mine

    async def _check_cluster(self, mine: str) -> None:
        cluster = await self._store.get(CLUSTER_KEY, linearizable=True)
        cluster_id = _cluster_id(cluster.value) if cluster is not None else None
        if cluster_id != mine:
            raise MetadataError(
                f"the store's cluster is {cluster_id or 'absent'}, this node's is "
                f"{mine}: not the store to ask about this node's ledgers"
            )

    async def _lookup(self, ledger_id: int) -> bytes | None:
        mine = self._mine()
        found = await self._store.get(ledger_key(ledger_id), linearizable=True)
        if found is not None:
            return found.value
        await self._check_cluster(mine)
        return None

    async def _orphaned(self, ledger_id: int, node_id: str) -> bool:
        mine = self._mine()
        if await self._store.get(lock_key(ledger_id), linearizable=True) is not None:
            return False  # a worker may be copying to this very replica
        await self._check_cluster(mine)
        found = await self._store.get(ledger_key(ledger_id), linearizable=True)
        if found is None:
            return False  # deleted meanwhile: the deleted ledgers' pass takes it
        try:
            return not names(decode(found.value), node_id)
        except MetadataFormatError as error:
            raise MetadataError(f"ledger {ledger_id}: {error}") from error


def names(meta: LedgerMetadata, node_id: str) -> bool:
    """Whether a segment of the ledger names the node (it holds a fragment of it)."""
    return any(node_id in segment.ensemble for segment in meta.segments)


def _cluster_id(value: bytes) -> str | None:
    try:
        return str(json.loads(value)["clusterId"])
    except (ValueError, KeyError, TypeError):
        return None


class Sweep:
    """The periodic pass that deletes replicas of ledgers the store no longer has."""

    def __init__(
        self,
        storage: ReplicaStorage,
        guard: StoreGuard,
        interval_s: float,
        grace_s: float,
        now_ms: Callable[[], int],
        on_skip: Callable[[], None] = lambda: None,
        on_reclaim: Callable[[], None] = lambda: None,
        orphans: OverReplicated | None = None,
    ) -> None:
        self._orphans = orphans  # the over-replicated pass, asked about ledgers that exist
        self._storage = storage
        self._guard = guard
        self._interval_s = interval_s
        self._grace_ms = grace_s * 1000
        self._now_ms = now_ms
        self._on_skip = on_skip
        self._on_reclaim = on_reclaim
        self._task: asyncio.Task[None] | None = None
        self.passes = 0
        self.reclaimed = 0
        self.skipped = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="replication-gc")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.sweep()
            except Exception:  # the next pass tries again; a bug must not end the sweeps
                log.exception("replica GC sweep failed")

    async def sweep(self) -> int:
        """One pass; the number of replicas of deleted ledgers deleted (the over-replicated
        ones deleted are ``orphans.reclaimed``)."""
        self.passes += 1
        deleted = 0
        now = self._now_ms()
        held = self._storage.replicated_ledgers()
        if self._orphans is not None:
            self._orphans.track([ledger_id for ledger_id, _created in held])
        for ledger_id, created_ms in held:
            if now - created_ms < self._grace_ms:
                continue
            try:
                metadata = await self._guard.lookup(ledger_id)
                if metadata is not None:
                    if self._orphans is not None:
                        await self._orphans.consider(ledger_id, metadata)
                    continue
            except MetadataError as error:  # counted by the guard
                log.warning("replica GC keeps ledger %d: %s", ledger_id, error)
                continue
            try:
                await self._storage.delete_ledger(ledger_id)
            except LedgerNotFound:
                continue  # deleted meanwhile
            except StorageError as error:  # a full disk, a failed WAL: the next pass retries
                self.skipped += 1
                self._on_skip()
                log.warning("replica GC could not delete ledger %d: %s", ledger_id, error)
                continue
            deleted += 1
            self.reclaimed += 1
            self._on_reclaim()
            log.info("replica of ledger %d deleted: the store has no such ledger", ledger_id)
        return deleted
