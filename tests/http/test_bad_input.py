# ruff: noqa: E501  (a table of cases reads best one case per line)
"""Bad input, through the production runner (NodeRunner) on a real socket: every refusal
is a 4xx JSON error, nothing is half-written, and the server keeps serving."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from node.http.app import NodeRunner, build_app
from tests.conftest import make_settings


@pytest.fixture
async def url(tmp_path: Path) -> AsyncIterator[str]:
    runner = NodeRunner(build_app(make_settings(tmp_path / "d")), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def _raw(url: str, request: bytes) -> tuple[int, dict[str, str]]:
    """Send bytes as they are (no client library to tidy them up); parse the reply."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(request)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1])
    return status, json.loads(body)


async def _still_serving(url: str) -> None:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/heartbeat") as r:
        assert r.status == 200


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GARBAGE\r\n\r\n",
        b"GET /heartbeat HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 40_000 + b"\r\n\r\n",
        b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
        b"POST /api/v1/ledgers HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
        b"POST /api/v1/ledgers HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n",
        b"GET /heartbeat HTTP/1.1\r\nHost: x\r\nBad Header Name: v\r\n\r\n",
    ],
    ids=["garbage", "huge-header", "huge-line", "negative-length", "smuggling", "bad-name"],
)
async def test_malformed_http_gets_a_json_4xx(url: str, request_bytes: bytes) -> None:
    status, body = await _raw(url, request_bytes)
    assert 400 <= status < 500
    assert set(body) == {"code", "message"} and body["code"]
    await _still_serving(url)


@pytest.mark.parametrize(
    ("method", "path", "body", "content_type", "status", "code"),
    [
        ("PUT", "/api/v1/ledgers/-3", None, None, 400, "invalid_id"),
        ("PUT", "/api/v1/ledgers/18446744073709551616", None, None, 400, "invalid_id"),
        ("PUT", "/api/v1/ledgers/9223372036854775808", None, None, 400, "invalid_id"),
        ("PUT", "/api/v1/ledgers/1/entries/-1", b"x", "application/octet-stream", 400, "invalid_id"),
        ("POST", "/api/v1/ledgers", b"\x00\xff garbage", "application/json", 400, "invalid_json"),
        ("POST", "/api/v1/ledgers", b'{"writeToken": 5}', "application/json", 400, "invalid_body"),
        ("POST", "/api/v1/ledgers/1/entries", b"\x00\x00\x00\x09abc", "application/x-entry-batch", 400, "invalid_frame"),
        ("POST", "/api/v1/ledgers/1/entries", b"x", "application/json", 415, "unsupported_media_type"),
        ("PUT", "/api/v1/ledgers/1/entries/0", b"x", "multipart/form-data", 415, "unsupported_media_type"),
        ("GET", "/api/v1/ledgers/1/lac?after=1&timeoutMs=-4", None, None, 400, "invalid_id"),
        ("DELETE", "/api/v1/bookie/state", None, None, 405, "method_not_allowed"),
    ],
)  # fmt: skip
async def test_bad_requests(
    url: str,
    method: str,
    path: str,
    body: bytes | None,
    content_type: str | None,
    status: int,
    code: str,
) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.put(f"{url}/api/v1/ledgers/1") as r:
            assert r.status == 201
        headers = {"Content-Type": content_type} if content_type else {}
        async with s.request(method, f"{url}{path}", data=body, headers=headers) as r:
            assert r.status == status, await r.text()
            assert (await r.json())["code"] == code
        async with s.get(f"{url}/api/v1/ledgers/1") as r:
            assert (await r.json())["entries"] == 0  # nothing half-added
    await _still_serving(url)
