"""The ledger check on real processes (etcd and three nodes on loopback, default settings): a
replica paused during a writer's adds and then crashed lacks the entries the writer
acknowledged at Qa and closed the ledger on; the audit route with ``checkLedgers`` (what the
DAG sends every run) finds it from its index, marks it "missing", and the rereplicate route
copies exactly those entries onto it. The replica's route answers with the ranges it lacks,
of a stripe when asked, page by page."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import aiohttp

from node.autorecovery import markers
from node.autorecovery.markers import Marker, Reason
from node.client import Client
from node.client.model import LedgerMetadata, LedgerState, Segment, encode, ledger_key
from node.localcluster import LocalCluster
from tests.autorecovery.test_autorecovery import metadata, payloads
from tests.harness.cluster import MakeCluster, held_by

SHAPE = (3, 3, 2)
BEFORE = 40  # entries every replica has: added before the pause
ENTRIES = 100
BATCH = 10


ENSEMBLE = ("n0", "n1", "n2")


async def plant(
    client: Client, write_quorum: int, data: list[bytes], lacking: dict[str, range]
) -> LedgerMetadata:
    """A CLOSED ledger on ENSEMBLE (E = 3, Qa = 2) put through the replica API, each node's
    ids in ``lacking`` left out, and its metadata written."""
    meta = LedgerMetadata(
        ledger_id=await client.store.next_id(),
        ensemble_size=3,
        write_quorum=write_quorum,
        ack_quorum=2,
        segments=(Segment(0, ENSEMBLE),),
        state=LedgerState.CLOSED,
        last_entry_id=len(data) - 1,
        length=sum(len(p) for p in data),
    )
    for entry_id, payload in enumerate(data):
        for node in meta.write_set(entry_id):
            if entry_id not in lacking.get(node, ()):
                await client.transport.add(
                    node, meta.ledger_id, [(entry_id, payload)], lac=-1, lac_length=0,
                    replication=(3, write_quorum, 2),
                )  # fmt: skip
    await client.store.create(ledger_key(meta.ledger_id), encode(meta))
    return meta


async def short_replica(cluster: LocalCluster, client: Client) -> tuple[int, str, list[bytes]]:
    """A CLOSED 3/3/2 ledger of ENTRIES entries whose replica ``slow`` was SIGSTOPped after
    BEFORE of them and SIGKILLed once the ledger was closed (the adds it never read die with
    it), then started again: (ledger id, slow, payloads)."""
    data = payloads(random.Random(44), ENTRIES)
    ledger = await client.create_ledger(*SHAPE)
    for start in range(0, BEFORE, BATCH):
        await ledger.add_batch(data[start : start + BATCH])
    slow = (await metadata(client, ledger.id)).segments[0].ensemble[1]
    await held_by(cluster, ledger.id, BEFORE - 1, [slow])  # acknowledged by the other two
    await asyncio.to_thread(cluster.stop, slow)
    for start in range(BEFORE, ENTRIES, BATCH):
        await ledger.add_batch(data[start : start + BATCH])  # complete at Qa = 2
    closed = await ledger.close()
    assert closed.state is LedgerState.CLOSED and closed.last_entry_id == ENTRIES - 1
    await asyncio.to_thread(cluster.kill, slow)
    await asyncio.to_thread(cluster.start, slow)
    return ledger.id, slow, data


async def get(http: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with http.get(url) as reply:
        body = await reply.read()
        return reply.status, (await reply.json() if body[:1] == b"{" else body)


async def post(http: aiohttp.ClientSession, url: str, body: object) -> tuple[int, Any]:
    async with http.post(url, json=body) as reply:
        return reply.status, await reply.json()


async def test_a_replica_left_short_of_a_closed_ledger_is_found_marked_and_filled(
    make_cluster: MakeCluster,
) -> None:
    cluster = await asyncio.to_thread(make_cluster, 3)
    async with Client(cluster.metadata_url) as client, aiohttp.ClientSession() as http:
        ledger_id, slow, data = await short_replica(cluster, client)
        before = await metadata(client, ledger_id)
        entries = f"{cluster.url(slow)}/api/v1/ledgers/{ledger_id}/entries"
        for entry_id in (0, BEFORE - 1, BEFORE, ENTRIES - 1):
            status, _ = await get(http, f"{entries}/{entry_id}")
            assert status == (200 if entry_id < BEFORE else 404), (entry_id, status)

        # The replica says, from its index, what it lacks: the ids it was paused through.
        asked = f"{cluster.url(slow)}/api/v1/ledgers/{ledger_id}/missing?from=0&to={ENTRIES - 1}"
        status, answer = await get(http, asked)
        assert (status, answer["missing"], answer["heldEntries"]) == (200, [[BEFORE, 99]], BEFORE)

        # The audit the DAG sends every run, through another node: found, marked "missing".
        caller = next(n for n in cluster.node_ids if n != slow)
        base = f"{cluster.url(caller)}/api/v1/autorecovery"
        status, report = await post(
            http, f"{base}/audit", {"metadataUrl": cluster.metadata_url, "checkLedgers": True}
        )
        assert status == 200, report
        assert report["markers"] == [ledger_id]
        assert report["entriesMissing"] == ENTRIES - BEFORE
        assert report["fragmentsChecked"] == 3 and report["replicasChecked"] == 0
        found = {m.ledger_id: m.nodes for m, _v in await markers.read_markers(client.store)}
        assert found == {ledger_id: {slow: Reason.MISSING}}

        # The same run's re-replication copies exactly what it lacks onto it, in place.
        status, result = await post(
            http,
            f"{base}/rereplicate",
            {"metadataUrl": cluster.metadata_url, "ledgerId": ledger_id},
        )
        assert status == 200, result
        assert (result["outcome"], result["fragments"], result["entries"]) == (
            "done",
            1,
            ENTRIES - BEFORE,
        )
        assert result["bytes"] == sum(len(p) for p in data[BEFORE:])
        assert await metadata(client, ledger_id) == before  # nothing moved
        assert await markers.read_markers(client.store) == []
        for node in cluster.node_ids:  # every replica, read directly, byte for byte
            for entry_id, payload in enumerate(data):
                status, stored = await get(
                    http, f"{cluster.url(node)}/api/v1/ledgers/{ledger_id}/entries/{entry_id}"
                )
                assert (status, stored) == (200, payload), (node, entry_id)

        status, report = await post(
            http, f"{base}/audit", {"metadataUrl": cluster.metadata_url, "checkLedgers": True}
        )
        assert (report["markers"], report["entriesMissing"]) == ([], 0)
        totals = await markers.read_totals(client.store)
        assert (totals.fragments, totals.entries) == (1, ENTRIES - BEFORE)


async def test_the_replica_route_answers_a_stripe_page_by_page(make_cluster: MakeCluster) -> None:
    """A 3/2/2 ledger planted through the replica API, n1 lacking ids 6-17: asked about its
    stripe (position 1: ids 0, 1, 3, 4, ...), it names only the stripe's ids it lacks, one
    range per page with limit=1; and refuses what makes no sense with stable codes."""
    cluster = await asyncio.to_thread(make_cluster, 3)
    async with Client(cluster.metadata_url) as client, aiohttp.ClientSession() as http:
        data = payloads(random.Random(7), 30)
        meta = await plant(client, 2, data, {"n1": range(6, 18)})
        ledger_id = meta.ledger_id
        route = f"{cluster.url('n1')}/api/v1/ledgers/{ledger_id}/missing"
        stripe = "ensembleSize=3&writeQuorumSize=2&position=1"
        held_by_n1 = [e for e in range(30) if "n1" in meta.write_set(e)]
        assert held_by_n1[:4] == [0, 1, 3, 4]

        pages: list[Any] = []
        at: int | None = 0
        while at is not None:
            status, answer = await get(http, f"{route}?from={at}&to=29&{stripe}&limit=1")
            assert status == 200, answer
            pages.append(answer["missing"])
            at = answer["nextFrom"]
        assert pages == [[[6, 7]], [[9, 10]], [[12, 13]], [[15, 16]]]
        status, answer = await get(http, f"{route}?from=0&to=29&{stripe}")
        assert answer["missingEntries"] == 8 and answer["heldEntries"] == len(held_by_n1) - 8
        # Without the stripe every id is asked about: the ids of the others' too.
        status, answer = await get(http, f"{route}?from=0&to=29")
        assert answer["missing"] == [[2, 2], [5, 17], [20, 20], [23, 23], [26, 26], [29, 29]]

        for query, code in (
            ("from=0&to=29&ensembleSize=3", (422, "invalid_stripe")),
            ("from=0&to=29&ensembleSize=3&writeQuorumSize=4&position=0", (422, "invalid_stripe")),
            ("from=0&to=29&ensembleSize=3&writeQuorumSize=2&position=3", (422, "invalid_stripe")),
            ("from=9&to=2", (422, "invalid_range")),
            ("from=0&to=29&limit=0", (400, "invalid_limit")),
            ("from=0", (400, "invalid_id")),
        ):
            status, answer = await get(http, f"{route}?{query}")
            assert (status, answer["code"]) == code, query
        status, answer = await get(
            http, f"{cluster.url('n1')}/api/v1/ledgers/{ledger_id + 1}/missing?to=3"
        )
        assert (status, answer["code"]) == (404, "ledger_not_found")

        # The audit marks n1 "missing" and the worker fills exactly its stripe's gaps.
        from node.autorecovery.auditor import audit
        from node.autorecovery.worker import rereplicate

        report = await audit(client, lost_node_delay_s=600, check_ledgers=True)
        assert report.markers == [ledger_id] and report.entries_missing == 8
        marked = [m for m, _v in await markers.read_markers(client.store)]
        assert marked == [Marker(ledger_id, {"n1": Reason.MISSING}, marked[0].created_ms)]
        result = await rereplicate(
            client, ledger_id, worker_id="test", open_ledger_grace_s=0, lock_ttl_s=5
        )
        assert (result.outcome, result.entries) == ("done", 8)
        status, answer = await get(http, f"{route}?from=0&to=29&{stripe}")
        assert answer["missing"] == [] and answer["heldEntries"] == len(held_by_n1)
        for entry_id in held_by_n1:
            stored = await client.transport.read_entry("n1", ledger_id, entry_id, fence=False)
            assert stored == data[entry_id]


async def test_every_replica_short_of_another_range_is_filled_from_the_others(
    make_cluster: MakeCluster,
) -> None:
    """A rolling restart's shape: each of the three replicas of a 3/3/2 ledger lacks another
    range (planted through the replica API). All three are marked "missing", and each is
    filled from the other two: a node only short of entries is a good source of the rest."""
    from node.autorecovery.auditor import audit
    from node.autorecovery.worker import rereplicate

    cluster = await asyncio.to_thread(make_cluster, 3)
    lacking = {"n0": range(10, 15), "n1": range(0, 5), "n2": range(5, 10)}
    async with Client(cluster.metadata_url) as client:
        data = payloads(random.Random(3), 20)
        ledger_id = (await plant(client, 3, data, lacking)).ledger_id
        report = await audit(client, lost_node_delay_s=600, check_ledgers=True)
        assert report.markers == [ledger_id] and report.entries_missing == 15
        [marker] = [m for m, _v in await markers.read_markers(client.store)]
        assert marker.nodes == dict.fromkeys(ENSEMBLE, Reason.MISSING)
        result = await rereplicate(
            client, ledger_id, worker_id="test", open_ledger_grace_s=0, lock_ttl_s=5
        )
        assert (result.outcome, result.fragments, result.entries) == ("done", 3, 15)
        for node in ENSEMBLE:
            for entry_id, payload in enumerate(data):
                stored = await client.transport.read_entry(node, ledger_id, entry_id, fence=False)
                assert stored == payload, (node, entry_id)
