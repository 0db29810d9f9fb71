"""Small replies written straight to the transport (node/http/rawreply.py): the same status,
body and headers as aiohttp's reply to the same request would carry, keep-alive as the
request asked, and aiohttp's own reply where its hooks add headers (Origin), the request is
HTTP/1.0 or a HEAD, its body is not all read, or the status has no body. On a real node (and
a bare app for the rules' edges) over loopback, raw connections."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestServer

from node import wire
from node.client.protocol import NODE_ID_HEADER
from node.http.middleware import REQUEST_ID_HEADER
from node.http.rawreply import SERVER_HEADER, write_whole
from node.http.state import SETTINGS
from node.settings import Settings
from tests.harness.rawhttp import Conn

STREAM = "raw"


def _get(path: str, *extra: str, version: str = "1.1") -> bytes:
    head = [f"GET {path} HTTP/{version}", "Host: localhost", *extra]
    return ("\r\n".join(head) + "\r\n\r\n").encode()


async def _connect(client: Any) -> Conn:
    return Conn(*await asyncio.open_connection(client.host, client.port))


async def _stream_of_two(client: Any) -> str:
    r = await client.put(f"/api/v1/streams/{STREAM}", json={})
    assert r.status == 201, await r.text()
    for payload in (b"one", b"two"):
        r = await client.post(f"/api/v1/streams/{STREAM}/entries", data=payload)
        assert r.status == 201, await r.text()
    return f"/api/v1/streams/{STREAM}/entries?from=0:0&limit=1"


async def test_a_small_read_is_written_whole_with_aiohttp_s_headers(client: Any) -> None:
    read = await _stream_of_two(client)
    conn = await _connect(client)
    try:
        await conn.send(_get(read, f"{REQUEST_ID_HEADER}: asked-1"))
        status, headers, body = await conn.answer()
        assert status == 200
        assert headers["server"] == SERVER_HEADER.decode()  # written raw
        assert headers["content-type"] == wire.STREAM_CONTENT_TYPE
        assert int(headers["content-length"]) == len(body)
        assert headers[NODE_ID_HEADER.lower()] == client.server.app[SETTINGS].id
        assert headers[REQUEST_ID_HEADER.lower()] == "asked-1"
        assert headers["x-next-position"].endswith(":1")
        assert [p for _, p in wire.decode_stream_frames(body)] == [b"one"]
        assert "date" in headers and "connection" not in headers
        # Kept alive: the next request on the same connection is answered, raw again.
        await conn.send(_get(read.replace("limit=1", "limit=2")))
        status, headers, body = await conn.answer()
        assert (status, headers["server"]) == (200, SERVER_HEADER.decode())
        assert [p for _, p in wire.decode_stream_frames(body)] == [b"one", b"two"]
    finally:
        conn.writer.close()


async def test_a_request_that_asks_to_close_gets_its_reply_then_the_close(client: Any) -> None:
    read = await _stream_of_two(client)
    conn = await _connect(client)
    try:
        await conn.send(_get(read, "Connection: close"))
        status, headers, body = await conn.answer()
        assert (status, headers["connection"]) == (200, "close")
        assert [p for _, p in wire.decode_stream_frames(body)] == [b"one"]
        assert await conn.closed_by_server()
    finally:
        conn.writer.close()


async def test_a_head_request_gets_the_head_alone(client: Any) -> None:
    """GET routes take HEAD too: aiohttp's reply, with no body, and the connection serves on."""
    read = await _stream_of_two(client)
    conn = await _connect(client)
    try:
        await conn.send(_get(read).replace(b"GET ", b"HEAD ", 1))
        head = await asyncio.wait_for(conn.reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 200 ") and SERVER_HEADER not in head
        await conn.send(_get(read))  # a body left behind would be read as this answer's head
        status, headers, body = await conn.answer()
        assert (status, headers["server"]) == (200, SERVER_HEADER.decode())
        assert [p for _, p in wire.decode_stream_frames(body)] == [b"one"]
    finally:
        conn.writer.close()


async def test_cross_origin_and_http_1_0_requests_get_aiohttp_s_reply(client: Any) -> None:
    read = await _stream_of_two(client)
    for extra, version in (("Origin: http://elsewhere.example", "1.1"), ("", "1.0")):
        conn = await _connect(client)
        try:
            await conn.send(_get(read, *([extra] if extra else []), version=version))
            status, headers, body = await conn.answer()
            assert status == 200
            assert headers["server"] != SERVER_HEADER.decode(), (extra, version)
            assert headers[NODE_ID_HEADER.lower()] == client.server.app[SETTINGS].id
            assert [p for _, p in wire.decode_stream_frames(body)] == [b"one"]
        finally:
            conn.writer.close()


async def test_a_post_is_written_raw_only_once_its_body_is_read(settings: Settings) -> None:
    """A reply sent while some of the request's body is unread would be answered before
    aiohttp has skipped that body; a 204 carries no length. A bare aiohttp app: the node's
    own middleware reads every body before its handler."""

    async def reply(request: web.Request) -> web.StreamResponse:
        if request.query.get("read") == "1":
            await request.read()
        status = int(request.query.get("status", "201"))
        body = b"" if status == 204 else b"done"
        written = write_whole(request, status, [("Content-Type", "text/plain")], body)
        return written or web.Response(status=status, body=body or None)

    app = web.Application()
    app[SETTINGS] = settings
    app.router.add_post("/", reply)
    server = TestServer(app)
    await server.start_server()
    conn = await _connect(server)
    body = b"x" * 100_000  # more than one read of the socket

    def post(query: str) -> bytes:
        head = f"POST /?{query} HTTP/1.1\r\nHost: localhost\r\nContent-Length: {len(body)}"
        return head.encode() + b"\r\n\r\n" + body

    try:
        for query, status, raw in (
            ("read=1", 201, True),
            ("read=0", 201, False),
            ("read=1&status=204", 204, False),
            ("read=1", 201, True),
        ):
            await conn.send(post(query))
            got, headers, answer = await conn.answer()
            assert got == status, query
            assert (headers.get("server") == SERVER_HEADER.decode()) is raw, (query, headers)
            assert answer == (b"" if status == 204 else b"done")
            if status == 204:
                assert "content-length" not in headers
    finally:
        conn.writer.close()
        await server.close()
