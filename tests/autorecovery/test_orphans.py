"""Orphan replicas of interrupted copies (node/replication/orphans.py) on real processes: etcd
and four nodes on loopback. A node SIGKILLed at its worker's ``autorecovery.after_copy`` crash
point leaves the replacement a replica no segment names: kept while the dead worker's lock
lives, then reclaimed, and the rerun copies afresh. A marker lock held, or etcd down, keeps an
orphan. A worker copying while the sweep runs (over-replicated grace 0: only the lock and the
delete's add check protect it) never loses the copy it then CASes in."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import time
from typing import Any

import aiohttp
import pytest

from node.autorecovery import markers
from node.autorecovery.auditor import audit
from node.autorecovery.markers import Lock
from node.autorecovery.worker import DONE, rereplicate
from node.client import Client
from node.client.model import NodeInfo, decode, ledger_key, node_key
from node.localcluster import LocalCluster
from tests.autorecovery.test_autorecovery import (
    FAST_ENV,
    assert_fully_replicated,
    gone_from_registry,
    holds,
    lose_a_fragment,
    metadata,
    write_ledger,
)
from tests.harness.cluster import MakeCluster

AFTER_COPY = "autorecovery.after_copy"
# Sweeps every second; the deleted-ledger grace short; an orphan reclaimed after 1 s quiet; a
# dead worker's lock gone after 4 s; checkpoints and GC often (a reclaimed replica's tombstone
# is purged soon, so that the rerun may copy to the same node again).
ORPHAN_ENV = {
    **FAST_ENV,
    "NODE_REPLICATION_GC_INTERVAL_S": "1",
    "NODE_REPLICATION_GC_GRACE_S": "1",
    "NODE_REPLICATION_OVERREPLICATED_GRACE_S": "1",
    "NODE_AUTORECOVERY_LOCK_TTL_S": "4",
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


async def orphan(client: Client, ledger_id: int) -> None:
    """A copy of the ledger's marked fragment to its replacement, interrupted before its CAS
    (the worker's lock goes with it)."""
    with pytest.raises(Interrupted):
        await rereplicate(
            client,
            ledger_id,
            worker_id="t",
            open_ledger_grace_s=0,
            lock_ttl_s=5,
            faults=Interrupt(),
        )


async def restart(
    cluster: LocalCluster, client: Client, node: str, env: dict[str, str] | None = None
) -> None:
    """Start ``node`` (SIGKILLed first if it runs), and wait until ``nodes/<node>`` is the new
    process's (the old one's lingers until its lease ends, and may vanish then a moment)."""
    since_ms = int(time.time() * 1000)
    if cluster.nodes[node].alive():
        await asyncio.to_thread(cluster.restart, node, env)
    else:
        await asyncio.to_thread(cluster.start, node, env)
    deadline = time.monotonic() + 15
    while True:
        found = await client.store.get(node_key(node))
        if found is not None and NodeInfo.decode(found.value).started_ms >= since_ms:
            return
        assert time.monotonic() < deadline, f"{node} not registered again"
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


async def test_a_copy_killed_before_its_cas_leaves_an_orphan_that_is_reclaimed(
    make_cluster: MakeCluster,
) -> None:
    """A node runs the re-replication route and SIGKILLs itself between the copy and the
    CAS: the replacement holds the whole fragment, the metadata does not name it. The orphan
    is kept while the dead worker's lock lives (longer than the grace), then reclaimed; the
    replicas the metadata names are never touched; the rerun copies afresh, counted once."""
    cluster = await asyncio.to_thread(make_cluster, 4, None, ORPHAN_ENV)
    async with Client(cluster.metadata_url) as client:
        lost = await lose_a_fragment(cluster, client, 31, 0)
        ledger_id, data, before = lost.ledger_id, lost.data, lost.before
        replacement, victim = lost.replacement, lost.victim
        survivors = [n for n in decode(before.value).segments[0].ensemble if n != victim]
        worker = survivors[0]
        crash = {"NODE_CRASH_POINTS": json.dumps([AFTER_COPY])}
        await restart(cluster, client, worker, crash)

        with pytest.raises(aiohttp.ClientError):
            await post_rereplicate(cluster, worker, ledger_id)
        proc = cluster.nodes[worker].proc
        assert proc is not None
        assert await asyncio.to_thread(proc.wait, 10) == -signal.SIGKILL  # at its crash point
        assert await holds(client, replacement, ledger_id) == len(data) - 1
        assert await client.store.get(ledger_key(ledger_id)) == before
        assert await markers.read_totals(client.store) == markers.Totals()

        # The dead worker's lock outlives the grace (4 s > 1 s): the orphan is kept meanwhile.
        kept_sweeps = 0
        start = (await replication(cluster, replacement))["gcSweeps"]
        while await client.store.get(markers.lock_key(ledger_id)) is not None:
            assert await holds(client, replacement, ledger_id) == len(data) - 1
            kept_sweeps = (await replication(cluster, replacement))["gcSweeps"] - start
            await asyncio.sleep(0.1)
        assert kept_sweeps >= 2, "no sweep ran while the dead worker's lock lived"
        await reclaimed(cluster, replacement, 1)
        assert await holds(client, replacement, ledger_id) == -1
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"{cluster.url(replacement)}/metrics") as resp,
        ):
            assert (
                "storage_node_replication_gc_overreplicated_reclaimed_total 1.0"
                in await resp.text()
            )
        for node in survivors[1:]:  # named by the metadata: untouched
            assert await holds(client, node, ledger_id) == len(data) - 1
            assert (await replication(cluster, node))["gcOverreplicatedReclaimed"] == 0

        await restart(cluster, client, worker, {"NODE_CRASH_POINTS": "[]"})
        await until_done(cluster, worker, ledger_id)
        size = sum(len(p) for p in data)
        assert await markers.read_totals(client.store) == markers.Totals(1, len(data), size)
        assert await markers.read_markers(client.store) == []
        await sweeps(cluster, replacement, 2)  # named now: later sweeps keep it
        await assert_fully_replicated(client, {ledger_id: data}, gone=victim)


async def test_a_held_marker_lock_or_etcd_down_keeps_the_orphan(
    make_cluster: MakeCluster,
) -> None:
    cluster = await asyncio.to_thread(make_cluster, 4, None, ORPHAN_ENV)
    async with Client(cluster.metadata_url) as client:
        lost = await lose_a_fragment(cluster, client, 33, 1)
        ledger_id, replacement = lost.ledger_id, lost.replacement
        last = len(lost.data) - 1
        await orphan(client, ledger_id)
        assert await holds(client, replacement, ledger_id) == last

        # A lock on the marker (a copy in flight): kept, sweep after sweep.
        lock = await client.store.create(markers.lock_key(ledger_id), Lock("w", 0).encode())
        await sweeps(cluster, replacement, 3)
        assert await holds(client, replacement, ledger_id) == last
        await client.store.delete(markers.lock_key(ledger_id), lock.revision)

        # etcd down: nothing can be confirmed; kept and counted skipped.
        skipped = (await replication(cluster, replacement))["gcSkipped"]
        await asyncio.to_thread(cluster.kill_etcd)
        try:
            await sweeps(cluster, replacement, 3)
            assert (await replication(cluster, replacement))["gcSkipped"] > skipped
            assert await holds(client, replacement, ledger_id) == last
            assert (await replication(cluster, replacement))["gcOverreplicatedReclaimed"] == 0
        finally:
            await asyncio.to_thread(cluster.restart_etcd)
        await reclaimed(cluster, replacement, 1)  # the store answers again: an orphan
        assert await holds(client, replacement, ledger_id) == -1


async def test_a_worker_copying_while_the_sweep_runs_never_loses_the_copy_it_cases_in(
    make_cluster: MakeCluster,
) -> None:
    """Over-replicated grace 0: nothing but the marker lock and the delete's check that no
    add came stand between the sweep and a copy. Three ledgers lose a node; for each, an
    interrupted copy leaves an orphan on the replacement, and a worker (a node's route, which
    waits 1.5 s between its copy and its CAS, over a sweep of the replacement) copies at once.
    Whatever the sweep reclaimed, every ledger ends with every entry on the Qw nodes of its
    segment, and stays so."""
    env = {**ORPHAN_ENV, "NODE_REPLICATION_OVERREPLICATED_GRACE_S": "0"}
    cluster = await asyncio.to_thread(make_cluster, 4, None, env)
    rng = random.Random(35)
    written: dict[int, list[bytes]] = {}
    async with Client(cluster.metadata_url) as client:
        for _ in range(3):
            data = [rng.randbytes(rng.randint(50, 300)) for _ in range(200)]
            written[await write_ledger(client, data)] = data
        ensembles = {lid: (await metadata(client, lid)).segments[0].ensemble for lid in written}
        victim = max(cluster.node_ids, key=lambda n: sum(n in e for e in ensembles.values()))
        assert all(victim in e for e in ensembles.values())  # 9 places on 4 nodes
        worker = next(n for n in cluster.node_ids if n != victim)
        slow = {"NODE_FAULTS": json.dumps([f"{AFTER_COPY}=delay:1.5"])}
        await restart(cluster, client, worker, slow)
        await asyncio.to_thread(cluster.wipe, victim)
        await gone_from_registry(client, victim)
        assert sorted((await audit(client, lost_node_delay_s=0)).markers) == sorted(written)

        overlapped = 0
        for ledger_id in written:
            (replacement,) = set(cluster.node_ids) - set(ensembles[ledger_id])
            await orphan(client, ledger_id)
            before = (await replication(cluster, replacement))["gcSweeps"]
            await until_done(cluster, worker, ledger_id)
            overlapped += (await replication(cluster, replacement))["gcSweeps"] - before
        assert overlapped >= len(written), "the sweeps did not run during the copies"
        size = sum(len(p) for d in written.values() for p in d)
        entries = sum(len(d) for d in written.values())
        assert await markers.read_totals(client.store) == markers.Totals(3, entries, size)
        await assert_fully_replicated(client, written, gone=victim)
        for node in set(cluster.node_ids) - {victim}:
            await sweeps(cluster, node, 2)
        await assert_fully_replicated(client, written, gone=victim)
