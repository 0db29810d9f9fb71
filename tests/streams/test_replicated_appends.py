"""The append path of replicated streams on etcd and real node processes: the owner answers
appends of its streams in the fast lane (node/http/fastlane.py), a node that does not own the
stream hands the connection to aiohttp, which forwards to the owner; an owner in its ledger's
ensemble stores its own copy without an HTTP request to itself (node/replication/local.py)."""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import aiohttp
import pytest

from node.http.fastlane import SERVER_HEADER
from node.http.frames import decode_stream_frames
from node.localcluster import LocalCluster
from tests.harness.cluster import MakeCluster
from tests.harness.metrics import Samples, parse_samples
from tests.harness.rawhttp import Conn
from tests.harness.streams import REPLICATED, call, owner, put_stream, stream_ledgers
from tests.streams.conftest import STREAM_CLUSTER_ENV

STREAM = "lane"


def _append(url: str, name: str, body: bytes) -> bytes:
    host = urlsplit(url).netloc
    head = (
        f"POST /api/v1/streams/{name}/entries HTTP/1.1\r\nHost: {host}\r\n"
        f"Content-Type: application/octet-stream\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def _connect(url: str) -> Conn:
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    return Conn(*await asyncio.open_connection(parts.hostname, parts.port))


async def test_the_owner_answers_appends_in_the_fast_lane_and_others_forward(
    stream_cluster: LocalCluster,
) -> None:
    first = stream_cluster.url("n0")
    status, body = await put_stream(first, STREAM, {"replication": REPLICATED})
    assert status == 201, body
    taking = await _connect(first)  # n0 takes the stream over at its first append
    await taking.send(_append(first, STREAM, b"first"))
    status, _headers, body = await taking.answer()
    taking.writer.close()
    assert status == 201, body
    found = await owner(stream_cluster, STREAM)
    assert found is not None
    other = next(n for n in stream_cluster.node_ids if n != found)
    at_owner = await _connect(stream_cluster.url(found))
    elsewhere = await _connect(stream_cluster.url(other))
    try:
        answers = []
        for n, (conn, node) in enumerate([(at_owner, found), (elsewhere, other)] * 2):
            await conn.send(_append(stream_cluster.url(node), STREAM, b"entry %d" % n))
            answers.append(await conn.answer())
        assert [status for status, _, _ in answers] == [201] * 4, answers
        # The owner's lane answered its appends (aiohttp's answers name aiohttp as the
        # server); the other node's went through aiohttp's route, forwarded to the owner.
        servers = [headers.get("server") for _, headers, _ in answers]
        assert servers[0::2] == [SERVER_HEADER.decode()] * 2, answers
        assert [headers.get("x-node-id") for _, headers, _ in answers] == [found, other] * 2
        positions = [body["position"] for _, _, body in answers]
        ledger = positions[0].split(":")[0]
        assert positions == [f"{ledger}:{i}" for i in range(1, 5)]
    finally:
        for conn in (at_owner, elsewhere):
            conn.writer.close()
    status, raw = await _read(stream_cluster.url(other))
    assert status == 200
    assert [payload for _, payload in decode_stream_frames(raw)] == [
        b"first",
        *(b"entry %d" % n for n in range(4)),
    ]


async def _read(url: str) -> tuple[int, bytes]:
    conn = await _connect(url)
    try:
        host = urlsplit(url).netloc
        head = f"GET /api/v1/streams/{STREAM}/entries?limit=10 HTTP/1.1\r\nHost: {host}\r\n\r\n"
        await conn.send(head.encode())
        status, _headers, body = await conn.answer()
        return status, body
    finally:
        conn.writer.close()


REPLICA_ROUTE = (("method", "POST"), ("route", "/api/v1/ledgers/{lid}/entries"))
RANGE_ROUTE = (("method", "GET"), ("route", "/api/v1/ledgers/{lid}/entries"))
APPENDS = 30


async def _samples(url: str) -> Samples:
    conn = await _connect(url)
    try:
        await conn.send(f"GET /metrics HTTP/1.1\r\nHost: {urlsplit(url).netloc}\r\n\r\n".encode())
        _status, _headers, body = await conn.answer()
        return parse_samples(body.decode())
    finally:
        conn.writer.close()


def _replica_requests(
    samples: Samples, route: tuple[tuple[str, str], ...] = REPLICA_ROUTE
) -> float:
    """Requests the node answered on ``route`` (default: the replica adds)."""
    name = "storage_node_http_request_duration_seconds_count"
    return sum(
        value
        for (sample, labels), value in samples.items()
        if sample == name and set(route) <= set(labels)
    )


@pytest.fixture
def three_nodes(make_cluster: MakeCluster) -> LocalCluster:
    """Three nodes: a 3/3/2 stream's owner holds a copy of every entry. No entry cache, so
    that the owner's stream reads go to the ledger's replicas."""
    return make_cluster(nodes=3, env={**STREAM_CLUSTER_ENV, "NODE_STREAM_ENTRY_CACHE_BYTES": "0"})


async def test_the_owner_stores_and_reads_its_own_copy_without_a_request_to_itself(
    three_nodes: LocalCluster,
) -> None:
    cluster = three_nodes
    first = cluster.url("n0")
    status, body = await put_stream(first, STREAM, {"replication": REPLICATED})
    assert status == 201, body
    conn = await _connect(first)
    try:
        for n in range(APPENDS):
            await conn.send(_append(first, STREAM, b"entry %d" % n))
            status, _headers, body = await conn.answer()
            assert status == 201, body
    finally:
        conn.writer.close()
    found = await owner(cluster, STREAM)
    assert found == "n0"
    (ledger,) = [info["id"] for info in await stream_ledgers(cluster, STREAM)]
    for node in cluster.node_ids:  # acknowledged at two copies: the third may come after
        await _holds(cluster.url(node), ledger, APPENDS - 1)
    samples = {node: await _samples(cluster.url(node)) for node in cluster.node_ids}
    assert _replica_requests(samples[found]) == 0
    assert all(_replica_requests(samples[node]) > 0 for node in cluster.node_ids if node != found)
    async with aiohttp.ClientSession() as session:
        for n in range(APPENDS):
            async with session.get(
                f"{cluster.url(found)}/api/v1/ledgers/{ledger}/entries/{n}"
            ) as r:
                assert (r.status, await r.read()) == (200, b"entry %d" % n)
    # The owner reads its stream from its own replica (the client's home node, read
    # locally): no range request reaches any node, and every entry comes back.
    status, raw = await _read(cluster.url(found))
    assert status == 200
    assert [p for _, p in decode_stream_frames(raw)] == [b"entry %d" % n for n in range(10)]
    for node in cluster.node_ids:
        assert _replica_requests(await _samples(cluster.url(node)), RANGE_ROUTE) == 0, node


async def _holds(url: str, ledger: int, last: int, timeout_s: float = 30.0) -> None:
    """Until the node's replica of ``ledger`` holds entries up to ``last``."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        status, meta = await call("GET", f"{url}/api/v1/ledgers/{ledger}")
        if status == 200 and meta["lastEntryId"] == last:
            return
        assert asyncio.get_running_loop().time() < deadline, (url, status, meta)
        await asyncio.sleep(0.1)
