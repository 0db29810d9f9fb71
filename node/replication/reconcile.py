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
errors, whichever path asked, and deletes the storage refused).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Protocol

from node.client.errors import ClientError, MetadataError
from node.client.metadata.store import MetadataStore
from node.client.model import CLUSTER_KEY, ledger_key
from node.replication.tasks import cancel_and_wait
from node.storage.errors import LedgerNotFound, StorageError

log = logging.getLogger(__name__)


class ReplicaStorage(Protocol):
    def replicated_ledgers(self) -> list[tuple[int, int]]:
        """(ledger id, created ms) of the replicated ledgers held here, not deleted."""

    async def delete_ledger(self, ledger_id: int, write_token: str | None = None) -> None: ...


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
        try:
            return await self._confirm(ledger_id)
        except MetadataError:
            self.errors += 1
            self._on_error()
            raise

    async def _confirm(self, ledger_id: int) -> bool:
        """True only when the store, read linearizably, has no ``ledgers/<id>`` and is this
        node's cluster. MetadataError when it cannot say (unreachable, slow, malformed)."""
        mine = self._cluster_id()
        if mine is None:
            raise MetadataError("this node's cookie is not checked yet")
        try:
            async with asyncio.timeout(self._timeout_s):
                found = await self._store.get(ledger_key(ledger_id), linearizable=True)
                if found is not None:
                    return False
                cluster = await self._store.get(CLUSTER_KEY, linearizable=True)
        except TimeoutError:
            raise MetadataError(f"the store did not answer in {self._timeout_s} s") from None
        except MetadataError:
            raise
        except ClientError as error:
            raise MetadataError(str(error)) from error
        cluster_id = _cluster_id(cluster.value) if cluster is not None else None
        if cluster_id != mine:
            raise MetadataError(
                f"the store's cluster is {cluster_id or 'absent'}, this node's is "
                f"{mine}: not the store to ask about this node's ledgers"
            )
        return True


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
    ) -> None:
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
        """One pass; the number of replicas deleted."""
        self.passes += 1
        deleted = 0
        now = self._now_ms()
        for ledger_id, created_ms in self._storage.replicated_ledgers():
            if now - created_ms < self._grace_ms:
                continue
            try:
                gone = await self._guard.confirm_deleted(ledger_id)
            except MetadataError as error:  # counted by the guard
                log.warning("replica GC keeps ledger %d: %s", ledger_id, error)
                continue
            if not gone:
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
