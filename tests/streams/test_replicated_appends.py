"""The append path of replicated streams on etcd and real node processes: the owner answers
appends of its streams in the fast lane (node/http/fastlane.py), a node that does not own the
stream hands the connection to aiohttp, which forwards to the owner."""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

from node.http.fastlane import SERVER_HEADER
from node.http.frames import decode_stream_frames
from node.localcluster import LocalCluster
from tests.harness.rawhttp import Conn
from tests.harness.streams import REPLICATED, owner, put_stream

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
