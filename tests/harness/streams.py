"""Streams over plain HTTP on a local cluster, and what etcd holds of them: the replicated
streams' tests call these (the cursor's read-back of a whole stream is node/jepsen/streams.py's
``read_back``, which the checker and the bench use too)."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from node.client.metadata.etcd import EtcdStore
from node.client.model import ledger_key
from node.jepsen.streams import StreamWorkload
from node.localcluster import LocalCluster
from tests.harness.node import NodeProcess

REPLICATED = {"ensemble": 3, "writeQuorum": 3, "ackQuorum": 2}
SINGLE_COPY = {"ensemble": 1, "writeQuorum": 1, "ackQuorum": 1}
# The prefixes of a stream's keys in etcd (under the cluster's prefix), each followed by the
# stream's name; doomed ledgers are keyed by ledger id.
STREAM_KEYS = ("streams/", "stream-cursors/", "stream-owners/")
DOOMED = "stream-doomed/"
CALL_TIMEOUT_S = 60.0  # one call of a test (a takeover may happen inside it)
POLL_S = 0.1


async def call(
    method: str, url: str, body: Any = None, timeout_s: float = CALL_TIMEOUT_S
) -> tuple[int, Any]:
    """One JSON request: (status, the JSON answer, or None when empty or not JSON)."""
    async with (
        aiohttp.ClientSession() as session,
        session.request(
            method, url, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as response,
    ):
        raw = await response.read()
        try:
            return response.status, json.loads(raw) if raw else None
        except ValueError:
            return response.status, None


async def put_stream(url: str, name: str, body: dict[str, Any]) -> tuple[int, Any]:
    return await call("PUT", f"{url}/api/v1/streams/{name}", body)


async def etcd_get(cluster: LocalCluster, key: str) -> Any:
    """The JSON value of ``key`` (under the cluster's prefix), None when absent."""
    store = EtcdStore(cluster.metadata_url)
    try:
        found = await store.get(key)
    finally:
        await store.close()
    return None if found is None else json.loads(found.value)


async def etcd_keys(cluster: LocalCluster, prefix: str) -> list[str]:
    """Every key under ``prefix`` (under the cluster's prefix)."""
    store = EtcdStore(cluster.metadata_url)
    try:
        return [key for key, _ in await store.range(prefix)]
    finally:
        await store.close()


async def stream_record(cluster: LocalCluster, name: str) -> Any:
    return await etcd_get(cluster, f"streams/{name}")


async def stream_ledgers(cluster: LocalCluster, name: str) -> list[dict[str, int]]:
    """The ledger list of ``streams/<name>`` ({"id", "entries", "bytes", "created",
    "closed"}, oldest first); AssertionError when there is no record."""
    record = await stream_record(cluster, name)
    assert record is not None, f"no streams/{name} in etcd"
    return list(record["ledgers"])


async def owner(cluster: LocalCluster, name: str) -> str | None:
    """The node id ``stream-owners/<name>`` names, None without an owner."""
    found = await etcd_get(cluster, f"stream-owners/{name}")
    return None if found is None else str(found["node"])


async def wait_owner(
    cluster: LocalCluster, name: str, among: set[str | None], timeout_s: float = 60.0
) -> str | None:
    """Until the owner of ``name`` is one of ``among`` (None: no owner); that owner."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        found = await owner(cluster, name)
        if found in among:
            return found
        if loop.time() > deadline:
            raise AssertionError(f"owner of {name} is {found}, not one of {among}")
        await asyncio.sleep(POLL_S)


async def node_ledger_ids(url: str) -> set[int]:
    """The ids of every ledger a node holds (``GET /api/v1/ledgers``)."""
    status, found = await call("GET", f"{url}/api/v1/ledgers")
    assert status == 200, (url, status, found)
    return {int(ledger["ledgerId"]) for ledger in found["ledgers"]}


async def leftovers(cluster: LocalCluster, name: str, ledger_ids: set[int]) -> list[str]:
    """What is left of a deleted stream: its etcd keys (record, cursors, owner), doomed and
    metadata keys of its ledgers, and each running node's replicas of them."""
    left = []
    for prefix in STREAM_KEYS:
        keys = await etcd_keys(cluster, f"{prefix}{name}")
        # streams/<name> is a prefix of streams/<name>-other as well: only this stream's.
        left += [k for k in keys if k == f"{prefix}{name}" or k.startswith(f"{prefix}{name}/")]
    return left + await ledger_leftovers(cluster, ledger_ids)


async def ledger_leftovers(cluster: LocalCluster, ledger_ids: set[int]) -> list[str]:
    """What is left of ledgers a stream dropped: their doomed and metadata keys in etcd, and
    each running node's replicas of them."""
    left = []
    for ledger_id in sorted(ledger_ids):
        for key in (f"{DOOMED}{ledger_id:019d}", ledger_key(ledger_id)):
            if await etcd_get(cluster, key) is not None:
                left.append(key)
    for node_id in cluster.node_ids:
        if cluster.node(node_id).alive():
            held = await node_ledger_ids(cluster.url(node_id)) & ledger_ids
            left += [f"{node_id} holds ledger {lid}" for lid in sorted(held)]
    return left


async def sigkill_and_restart(
    load: StreamWorkload, node: NodeProcess, restart: Callable[[], Awaitable[NodeProcess]]
) -> tuple[NodeProcess, float]:
    """SIGKILL ``node`` (appends of ``load`` in flight), start it again with ``restart`` and
    send ``load``'s requests there: the new node, and when the kill was sent."""
    killed_at = time.time()
    assert node.proc is not None
    node.proc.send_signal(signal.SIGKILL)
    await asyncio.to_thread(node.kill)
    again = await restart()
    load.urls[:] = [again.url]
    return again, killed_at
