"""What the stream routes answer on a fleet, on etcd and real node
processes: a fleet whose registrations the store lost says metadata_unavailable, not
not_enough_nodes; a request claiming a forward says what happened; the list of streams comes
a page at a time, the ones other nodes own included."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import aiohttp

from node.client.metadata.etcd import EtcdStore
from node.client.model import NODES_PREFIX
from node.http.forward import FORWARDED_BY
from node.localcluster import LocalCluster
from tests.harness.cluster import MakeCluster
from tests.harness.streams import REPLICATED, call, put_stream

# Nodes renew their registration every third of it: a lost one comes back only after up to
# 10 s, a window the test's requests fall in (they take milliseconds).
REGISTRATION_TTL_S = 30
OCTET = {"Content-Type": "application/octet-stream"}


async def _append(url: str, name: str, **headers: str) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"{url}/api/v1/streams/{name}/entries", data=b"x", headers={**OCTET, **headers}
        ) as response,
    ):
        return response.status, await response.json()


async def _registration_leases(cluster: LocalCluster) -> list[int]:
    """The leases of the nodes' registrations, as etcd holds them (the store's API gives
    values, not leases)."""
    store = EtcdStore(cluster.metadata_url)
    prefix = f"{store.prefix}{NODES_PREFIX}".encode()
    await store.close()
    end = prefix[:-1] + bytes([prefix[-1] + 1])
    body = {"key": base64.b64encode(prefix).decode(), "range_end": base64.b64encode(end).decode()}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{cluster.etcd.client_url}/v3/kv/range", json=body) as response,
    ):
        answer = await response.json()
    return [int(kv["lease"]) for kv in answer.get("kvs", [])]


async def test_lost_registrations_are_the_store_s_fault_not_too_few_nodes(
    make_cluster: MakeCluster,
) -> None:
    """The nodes' leases end in etcd (as they all do when etcd comes back from a pause longer
    than the TTL): the next new ledger finds no node registered, this one included. That is
    the store's list being stale, 503 metadata_unavailable; an ensemble larger than the
    fleet stays 503 not_enough_nodes."""
    env = {"NODE_REGISTRATION_TTL_S": str(REGISTRATION_TTL_S)}
    cluster = await asyncio.to_thread(make_cluster, 3, None, env)
    url = cluster.url("n0")
    wide = {"ensemble": 4, "writeQuorum": 4, "ackQuorum": 2}
    assert (await put_stream(url, "wide", {"replication": wide}))[0] == 201
    status, body = await _append(url, "wide")
    assert (status, body["code"]) == (503, "not_enough_nodes"), body

    leases = await _registration_leases(cluster)
    assert len(leases) == 3
    store = EtcdStore(cluster.metadata_url)
    try:
        for lease in leases:
            await store.revoke(lease)
    finally:
        await store.close()
    assert (await put_stream(url, "s", {"replication": REPLICATED}))[0] == 201
    status, body = await _append(url, "s")
    assert (status, body["code"]) == (503, "metadata_unavailable"), body
    assert "no registration of this node ('n0')" in body["message"], body
    assert await _registration_leases(cluster) == []  # still in the window


async def test_a_forged_forward_and_the_fleet_s_list_in_pages(make_cluster: MakeCluster) -> None:
    cluster = await asyncio.to_thread(make_cluster, 3)
    n0, n1 = cluster.url("n0"), cluster.url("n1")
    names = ["a", "b", "c", "d", "e"]
    for i, name in enumerate(names):  # owners n0, n1, n2, n0, n1
        owner = cluster.url(cluster.node_ids[i % 3])
        status, body = await put_stream(owner, name, {"replication": REPLICATED})
        assert status == 201 and body["owner"] == cluster.node_ids[i % 3], body

    # A request to a node that does not own the stream, claiming a forward already.
    status, body = await call("GET", f"{n1}/api/v1/streams/a")  # forwarded to n0
    assert status == 200 and body["owner"] == "n0"
    async with aiohttp.ClientSession() as session:
        for by, expected in (("mallory", (400, "invalid_header")), ("n2", (503, "not_owner"))):
            async with session.get(
                f"{n1}/api/v1/streams/a", headers={FORWARDED_BY: by}
            ) as response:
                answer = await response.json()
                assert (response.status, answer["code"]) == expected, answer
            message = answer["message"]
            assert f"served by the node at {n0}, not by this node ('n1')" in message, message
            if by == "mallory":
                assert "'mallory', which names no node of the fleet" in message, message
            else:
                assert "node 'n2' forwarded this request here" in message, message
                assert "ownership moved" in message, message

    # The list, through any node, a page at a time: every stream of the fleet once.
    for url in (n0, n1):
        listed: list[str] = []
        while True:
            status, page = await call("GET", f"{url}/api/v1/streams?offset={len(listed)}&limit=2")
            assert status == 200 and page["total"] == len(names) and page["limit"] == 2, page
            if not page["streams"]:
                break
            assert len(page["streams"]) <= 2
            listed += [s["name"] for s in page["streams"]]
        assert listed == names
    status, page = await call("GET", f"{n0}/api/v1/streams")
    assert [(s["name"], s["owner"]) for s in page["streams"]] == [
        (name, cluster.node_ids[i % 3]) for i, name in enumerate(names)
    ]
