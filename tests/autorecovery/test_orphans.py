"""Orphan replicas of interrupted copies (node/replication/orphans.py) on real processes: etcd
and four nodes on loopback. A marker lock held, or etcd down, keeps an orphan; once neither,
it is reclaimed and GC forgets it. A worker copying while the sweep runs (over-replicated
grace 0: only the lock and the delete's add check protect it) never loses the copy it then
CASes in. A node SIGKILLed at its worker's ``autorecovery.after_copy`` crash point under the
DAG, its orphan reclaimed and the DAG run again: tests/airflow/test_autorecovery_run.py."""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

import aiohttp

from node.autorecovery import markers
from node.autorecovery.auditor import audit
from node.autorecovery.markers import Lock
from node.autorecovery.worker import DONE, rereplicate
from node.client import Client
from node.client.errors import NotEnoughNodes
from node.client.model import node_key
from node.localcluster import LocalCluster
from tests.autorecovery.test_autorecovery import (
    FAST_ENV,
    SHAPE,
    assert_fully_replicated,
    gone_from_registry,
    holds,
    metadata,
    payloads,
    write_ledger,
)
from tests.harness.cluster import MakeCluster

AFTER_COPY = "autorecovery.after_copy"
PLACEMENT_ATTEMPTS = 3  # interrupted copies tried while a node's short registration lapsed
# Sweeps every second; the deleted-ledger grace short; an orphan reclaimed after 1 s quiet; a
# dead worker's lock gone after 3 s; checkpoints and GC often (a reclaimed replica's tombstone
# is purged soon, so that the rerun may copy to the same node again).
ORPHAN_ENV = {
    **FAST_ENV,
    "NODE_REPLICATION_GC_INTERVAL_S": "1",
    "NODE_REPLICATION_GC_GRACE_S": "1",
    "NODE_REPLICATION_OVERREPLICATED_GRACE_S": "1",
    "NODE_AUTORECOVERY_LOCK_TTL_S": "3",
    "NODE_METADATA_TIMEOUT_S": "1",
    "NODE_FLUSH_INTERVAL_MS": "500",
    "NODE_GC_WAIT_TIME_MS": "500",
}


class Interrupted(Exception):
    """Raised at the worker's crash point: the copy is made, its CAS never sent."""


class Interrupt:
    def hit(self, name: str) -> None:
        if name == AFTER_COPY:
            raise Interrupted(name)


async def orphan(client: Client, ledger_id: int, nodes: list[str]) -> None:
    """A copy of the ledger's marked fragment to its replacement, interrupted before its CAS
    (the worker's lock goes with it). These nodes register for 2 s (FAST_ENV): on a loaded
    machine one may lapse for a moment, and with it the only replacement; the worker's
    next run would try again, and so does this, once ``nodes`` are all registered."""
    for attempt in range(PLACEMENT_ATTEMPTS):
        try:
            await rereplicate(
                client,
                ledger_id,
                worker_id="t",
                open_ledger_grace_s=0,
                lock_ttl_s=5,
                faults=Interrupt(),
            )
        except Interrupted:
            return
        except NotEnoughNodes as error:
            if attempt == PLACEMENT_ATTEMPTS - 1:  # say what placement saw
                seen = [(n.node_id, n.state.value) for n in await client.registry.candidates()]
                lost = [key for key, _ in await client.store.range(markers.LOST_PREFIX)]
                raise AssertionError(f"{error}; registered {seen}; lost {lost}") from error
            await registered(client, nodes)
            continue
        raise AssertionError(f"the copy of ledger {ledger_id} was not interrupted")


async def registered(client: Client, nodes: list[str]) -> None:
    """Until every node is registered (after an etcd restart each registers again, at its
    own pace: a ledger written before would leave the late ones out of its ensemble)."""
    deadline = time.monotonic() + 30
    while any([await client.store.get(node_key(n)) is None for n in nodes]):
        assert time.monotonic() < deadline, "not every node registered again"
        await asyncio.sleep(0.1)


async def replication(cluster: LocalCluster, node: str) -> dict[str, Any]:
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"{cluster.url(node)}/api/v1/status/summary") as resp,
    ):
        assert resp.status == 200
        return dict((await resp.json())["replication"])


async def sweeps(cluster: LocalCluster, node: str, count: int) -> None:
    """Until ``node`` has run ``count`` more sweeps."""
    start = (await replication(cluster, node))["gcSweeps"]
    deadline = time.monotonic() + count + 10
    while (await replication(cluster, node))["gcSweeps"] < start + count:
        assert time.monotonic() < deadline, f"{node} does not sweep"
        await asyncio.sleep(0.1)


async def reclaimed(cluster: LocalCluster, node: str, count: int) -> None:
    deadline = time.monotonic() + 20
    while (await replication(cluster, node))["gcOverreplicatedReclaimed"] < count:
        assert time.monotonic() < deadline, f"{node}'s orphan never reclaimed"
        await asyncio.sleep(0.1)


async def purged(cluster: LocalCluster, node: str, count: int) -> None:
    """Until ``node``'s GC has forgotten ``count`` deleted ledgers (their tombstones)."""
    deadline = time.monotonic() + 20
    while True:
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"{cluster.url(node)}/api/v1/status/summary") as resp,
        ):
            if (await resp.json())["gc"]["deletedLedgers"] >= count:
                return
        assert time.monotonic() < deadline, f"{node}'s GC never purged the tombstone"
        await asyncio.sleep(0.1)


async def post_rereplicate(cluster: LocalCluster, node: str, ledger_id: int) -> tuple[int, Any]:
    body = {"metadataUrl": cluster.metadata_url, "ledgerId": ledger_id}
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{cluster.url(node)}/api/v1/autorecovery/rereplicate", json=body) as resp,
    ):
        return resp.status, await resp.json()


async def until_done(cluster: LocalCluster, node: str, ledger_id: int) -> int:
    """Re-replicate through ``node``'s route until DONE (a copy refused because its
    replacement's replica was reclaimed, and not purged yet, is tried again); the attempts."""
    deadline = time.monotonic() + 45
    attempts = 0
    while True:
        attempts += 1
        status, answer = await post_rereplicate(cluster, node, ledger_id)
        if status == 200 and answer["outcome"] == DONE:
            return attempts
        assert status in (200, 409, 503), (status, answer)
        assert time.monotonic() < deadline, (status, answer)
        await asyncio.sleep(0.3)


async def test_orphans_are_kept_under_a_lock_or_etcd_down_and_a_copy_racing_the_sweep_lands(
    make_cluster: MakeCluster,
) -> None:
    """Over-replicated grace 0, and every node's worker waits 1.5 s between its copy and its
    CAS (the window where only the marker lock keeps the sweep off the copy).

    Guards: a closed ledger on three of the four nodes; the fourth is sent its entries as a
    worker sends them (recovery adds), no CAS following: an orphan. A lock on the ledger's
    marker keeps it sweep after sweep; so does etcd down (counted skipped); once the store
    answers and no lock is held, it is reclaimed, and GC purges its tombstone.

    Race: two ledgers lose a node; for each, an interrupted copy leaves an orphan on the
    replacement, and a worker (a node's route) starts copying at a random moment of the
    sweep's second. Whatever the sweep reclaimed meanwhile (a refused copy is run again),
    every ledger ends with every entry on the Qw nodes of its segment, counted once, and
    stays so over later sweeps."""
    env = {
        **ORPHAN_ENV,
        "NODE_REPLICATION_OVERREPLICATED_GRACE_S": "0",
        "NODE_FAULTS": json.dumps([f"{AFTER_COPY}=delay:1.5"]),
    }
    cluster = await asyncio.to_thread(make_cluster, 4, None, env)
    rng = random.Random(33)
    async with Client(cluster.metadata_url) as client:
        data = payloads(rng, 40)
        guarded = await write_ledger(client, data)
        meta = await metadata(client, guarded)
        (outsider,) = set(cluster.node_ids) - set(meta.segments[0].ensemble)
        lock = await client.store.create(markers.lock_key(guarded), Lock("w", 0).encode())
        await client.transport.add(
            outsider,
            guarded,
            list(enumerate(data)),
            lac=meta.last_entry_id,
            lac_length=meta.length,
            replication=SHAPE,
            recovery=True,
        )
        last = len(data) - 1
        assert await holds(client, outsider, guarded) == last

        # A lock on the marker (a copy in flight): kept, sweep after sweep.
        await sweeps(cluster, outsider, 2)
        assert await holds(client, outsider, guarded) == last
        await client.store.delete(markers.lock_key(guarded), lock.revision)

        # etcd down: nothing can be confirmed; kept and counted skipped.
        skipped = (await replication(cluster, outsider))["gcSkipped"]
        await asyncio.to_thread(cluster.kill_etcd)
        try:
            # Two: the first to end may have begun, and asked the store, before the kill.
            await sweeps(cluster, outsider, 2)
            assert (await replication(cluster, outsider))["gcSkipped"] > skipped
            assert await holds(client, outsider, guarded) == last
            assert (await replication(cluster, outsider))["gcOverreplicatedReclaimed"] == 0
        finally:
            await asyncio.to_thread(cluster.restart_etcd)
        await registered(client, cluster.node_ids)  # each node registers again
        await reclaimed(cluster, outsider, 1)  # the store answers again: an orphan
        assert await holds(client, outsider, guarded) == -1
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"{cluster.url(outsider)}/metrics") as resp,
        ):
            exported = await resp.text()
        assert "storage_node_replication_gc_overreplicated_reclaimed_total 1.0" in exported
        await purged(cluster, outsider, 1)
        await assert_fully_replicated(client, {guarded: data})

        written = {guarded: data}
        for _ in range(2):
            data = payloads(rng, 120)
            written[await write_ledger(client, data)] = data
        ensembles = {lid: (await metadata(client, lid)).segments[0].ensemble for lid in written}
        racing = list(written)[1:]
        # Six places on four nodes: one node is in both racing ledgers.
        victim = next(n for n in cluster.node_ids if all(n in ensembles[i] for i in racing))
        worker = next(n for n in cluster.node_ids if n != victim)
        await asyncio.to_thread(cluster.wipe, victim)
        await gone_from_registry(client, victim)
        # An audit at lost_node_delay_s=0 marks any node it finds unregistered as lost (and
        # no replacement may be one), so every other node is registered first.
        await registered(client, [n for n in cluster.node_ids if n != victim])
        marked = sorted(i for i in written if victim in ensembles[i])
        assert sorted((await audit(client, lost_node_delay_s=0)).markers) == marked

        overlapped = 0
        for ledger_id in marked:
            (replacement,) = set(cluster.node_ids) - set(ensembles[ledger_id])
            await orphan(client, ledger_id, [n for n in cluster.node_ids if n != victim])
            await asyncio.sleep(rng.uniform(0, 1.2))
            before = (await replication(cluster, replacement))["gcSweeps"]
            await until_done(cluster, worker, ledger_id)
            overlapped += (await replication(cluster, replacement))["gcSweeps"] - before
        assert overlapped >= len(marked), "the sweeps did not run during the copies"
        size = sum(len(p) for i in marked for p in written[i])
        entries = sum(len(written[i]) for i in marked)
        totals = markers.Totals(len(marked), entries, size)
        assert await markers.read_totals(client.store) == totals
        await assert_fully_replicated(client, written, gone=victim)
        live = set(cluster.node_ids) - {victim}
        await asyncio.gather(*(sweeps(cluster, node, 2) for node in live))
        await assert_fully_replicated(client, written, gone=victim)
