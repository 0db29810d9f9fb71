"""The over-replicated pass (node/replication/orphans.py) at its default grace, on a real
etcd and a real storage engine, the clock the test's: a replica no segment names is kept while
young, while a marker lock is held, and after any replica add; it is deleted once quiet for the
grace; a replica its ledger names is never touched; an add between the store's answer and the
delete keeps it. The processes' view is tests/autorecovery/test_orphans.py."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from node.autorecovery.markers import Lock, lock_key
from node.client.metadata.etcd import EtcdStore
from node.client.metadata.store import LEDGER_ID_BASE
from node.client.model import CLUSTER_KEY, LedgerMetadata, Segment, encode, ledger_key
from node.replication.orphans import OrphanReclaim
from node.replication.reconcile import StoreGuard, Sweep
from node.settings import Settings
from node.storage.adds import ReplicaAdd
from node.storage.ledgers import LedgerStorage
from tests.harness.etcd import EtcdServer
from tests.replication._identity import fresh_prefix

ME = "n-me"
ORPHAN = LEDGER_ID_BASE + 11  # its segments name a, b, c: never this node
NAMED = LEDGER_ID_BASE + 12  # its segment names this node
SHAPE = (3, 3, 2)
DAY_S = Settings.model_fields["replication_overreplicated_grace_s"].default
GC_GRACE_S = Settings.model_fields["replication_gc_grace_s"].default
ENTRIES = [(i, f"entry {i}".encode()) for i in range(5)]


def _metadata(ledger_id: int, ensemble: tuple[str, ...]) -> bytes:
    return encode(LedgerMetadata(ledger_id, *SHAPE, segments=(Segment(0, ensemble),)))


async def _replica(storage: LedgerStorage, ledger_id: int, recovery: bool = False) -> None:
    await storage.add_replica(ledger_id, ENTRIES, ReplicaAdd(SHAPE, lac=-1, recovery=recovery))


def _held(storage: LedgerStorage) -> list[int]:
    return sorted(ledger_id for ledger_id, _created in storage.replicated_ledgers())


@dataclass
class Rig:
    store: EtcdStore
    storage: LedgerStorage
    guard: StoreGuard
    orphans: OrphanReclaim
    sweep: Sweep
    now: dict[str, int]

    async def at(self, ms: int) -> None:
        """One sweep with the clock at ``ms``."""
        self.now["ms"] = ms
        await self.sweep.sweep()


@pytest.fixture
async def rig(storage: LedgerStorage, etcd: EtcdServer) -> AsyncIterator[Rig]:
    """This node (ME) holds replicas of ORPHAN and NAMED, both in the store; the sweep's
    deleted-ledger grace is past; the over-replicated grace is the default's."""
    store = EtcdStore(etcd.url(fresh_prefix()))
    try:
        await store.create(CLUSTER_KEY, json.dumps({"clusterId": "c-1"}).encode())
        await store.create(ledger_key(ORPHAN), _metadata(ORPHAN, ("a", "b", "c")))
        await store.create(ledger_key(NAMED), _metadata(NAMED, ("a", ME, "c")))
        await _replica(storage, ORPHAN)
        await _replica(storage, NAMED)
        created = max(created for _id, created in storage.replicated_ledgers())
        now = {"ms": created + GC_GRACE_S * 1000}
        guard = StoreGuard(store, lambda: "c-1", timeout_s=5)
        orphans = OrphanReclaim(storage, guard, ME, DAY_S, lambda: now["ms"])
        sweep = Sweep(storage, guard, 600, GC_GRACE_S, lambda: now["ms"], orphans=orphans)
        yield Rig(store, storage, guard, orphans, sweep, now)
    finally:
        await store.close()


async def test_at_the_default_grace_a_young_orphan_is_kept_a_day_quiet_one_reclaimed(
    rig: Rig,
) -> None:
    assert DAY_S == 86_400  # BookKeeper's gcOverreplicatedLedgerWaitTime
    t0 = rig.now["ms"]
    await rig.at(t0)  # first seen: its quiet time starts
    await rig.at(t0 + DAY_S * 1000 - 1)
    assert _held(rig.storage) == [ORPHAN, NAMED], "a young orphan was reclaimed"

    # A worker holds the ledger's marker lock: a copy to this node may be in flight.
    lock = await rig.store.create(lock_key(ORPHAN), Lock("w", t0).encode())
    await rig.at(t0 + DAY_S * 1000)
    assert _held(rig.storage) == [ORPHAN, NAMED], "reclaimed under a worker's lock"
    await rig.store.delete(lock_key(ORPHAN), lock.revision)

    # A recovery add (the same bytes again, as a rerun's copy): the day starts anew.
    await _replica(rig.storage, ORPHAN, recovery=True)
    await rig.at(t0 + DAY_S * 1000 + 1)
    await rig.at(t0 + 2 * DAY_S * 1000)
    assert _held(rig.storage) == [ORPHAN, NAMED], "reclaimed within a day of an add"
    await rig.at(t0 + 2 * DAY_S * 1000 + 1)
    assert _held(rig.storage) == [NAMED]
    assert rig.orphans.reclaimed == 1 and rig.guard.errors == 0
    await rig.at(t0 + 10 * DAY_S * 1000)
    assert _held(rig.storage) == [NAMED], "a replica its ledger names was deleted"


async def test_an_add_between_the_store_s_answer_and_the_delete_keeps_the_replica(
    rig: Rig,
) -> None:
    """The store says orphan (no lock, no segment names this node); a worker then takes the
    lock and copies before the delete (as it may, the moment after the answer): the delete
    sees the add and keeps the replica. Then the same worker's CAS names this node: never
    reclaimed after."""
    asked = rig.guard.orphaned

    async def answered_then_copied(ledger_id: int, node_id: str) -> bool:
        answer = await asked(ledger_id, node_id)
        await _replica(rig.storage, ledger_id, recovery=True)  # the worker's copy lands
        return answer

    rig.guard.orphaned = answered_then_copied  # type: ignore[method-assign]
    t0 = rig.now["ms"]
    await rig.at(t0)
    await rig.at(t0 + DAY_S * 1000)
    assert _held(rig.storage) == [ORPHAN, NAMED]
    assert rig.orphans.reclaimed == 0
    # The worker's CAS: ME replaces c.
    found = await rig.store.get(ledger_key(ORPHAN))
    assert found is not None
    await rig.store.cas(ledger_key(ORPHAN), _metadata(ORPHAN, ("a", "b", ME)), found.revision)
    await rig.at(t0 + 5 * DAY_S * 1000)
    await rig.at(t0 + 10 * DAY_S * 1000)
    assert _held(rig.storage) == [ORPHAN, NAMED]


async def test_a_store_of_another_cluster_or_unreadable_metadata_keeps_everything(
    rig: Rig,
) -> None:
    t0 = rig.now["ms"]
    await rig.at(t0)
    cluster = await rig.store.get(CLUSTER_KEY)
    assert cluster is not None
    await rig.store.cas(CLUSTER_KEY, json.dumps({"clusterId": "c-2"}).encode(), cluster.revision)
    await rig.at(t0 + DAY_S * 1000)
    assert _held(rig.storage) == [ORPHAN, NAMED]
    assert rig.guard.errors == 1  # asked about ORPHAN only: NAMED is named

    cluster = await rig.store.get(CLUSTER_KEY)
    assert cluster is not None
    await rig.store.cas(CLUSTER_KEY, json.dumps({"clusterId": "c-1"}).encode(), cluster.revision)
    found = await rig.store.get(ledger_key(ORPHAN))
    assert found is not None
    await rig.store.cas(ledger_key(ORPHAN), b'{"formatVersion": 99}', found.revision)
    await rig.at(t0 + 2 * DAY_S * 1000)
    assert _held(rig.storage) == [ORPHAN, NAMED]
    assert rig.orphans.skipped == 1 and rig.orphans.reclaimed == 0
