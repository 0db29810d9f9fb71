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

from node.http import openapi
from node.http.app import NodeRunner, build_app
from tests.harness.settings import make_settings


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
        # Rules that routes once applied differently, one rule each.
        # from > to is well formed (400 is for what breaks a schema of /openapi.json), but
        # refused for what it means: 422, as a minimum rollover time above the maximum.
        ("GET", "/api/v1/ledgers/1/entries?from=5&to=2", None, None, 422, "invalid_range"),
        # An empty batch is refused alike on a ledger and on a stream.
        ("POST", "/api/v1/ledgers/1/entries", b"", "application/x-entry-batch", 400, "empty_batch"),
        ("POST", "/api/v1/streams/s/entries", b"", "application/x-entry-batch", 400, "empty_batch"),
        # Ids are canonical: "00001" is not a second name of ledger 1.
        ("GET", "/api/v1/ledgers/00001", None, None, 400, "invalid_id"),
        ("PUT", "/api/v1/ledgers/00100", None, None, 400, "invalid_id"),
        ("GET", "/api/v1/ledgers/1/entries/00", None, None, 400, "invalid_id"),
        ("GET", "/api/v1/ledgers/1/entries?from=01", None, None, 400, "invalid_id"),
        ("GET", "/api/v1/streams/s/entries?from=01:0", None, None, 400, "invalid_position"),
        # Invalid JSON is invalid_json on every route.
        ("PUT", "/api/v1/bookie/gc", b"{nope", "application/json", 400, "invalid_json"),
        ("PUT", "/api/v1/bookie/state/readonly", b"{nope", "application/json", 400, "invalid_json"),
        ("PUT", "/api/v1/bookie/gc/suspend_compaction", b"{nope", "application/json", 400, "invalid_json"),
        ("PUT", "/api/v1/bookie/gc", b"NaN", "application/json", 400, "invalid_json"),
        # Unknown keys are refused everywhere.
        ("PUT", "/api/v1/bookie/state/readonly", b'{"readOnly": false, "x": 1}', "application/json", 400, "invalid_body"),
        ("PUT", "/api/v1/bookie/gc", b'{"forceMajor": false, "x": 1}', "application/json", 400, "invalid_body"),
        ("PUT", "/api/v1/streams/s", b'{"maxEntriesPerLedger": 5, "x": 1}', "application/json", 400, "invalid_policy"),
        # Every policy value is bounded.
        ("PUT", "/api/v1/streams/s", b'{"maxEntriesPerLedger": 1000000000000000000000000000000}', "application/json", 400, "invalid_policy"),
        ("PUT", "/api/v1/streams/s", b'{"messageTtlInSeconds": 2147483648}', "application/json", 400, "invalid_policy"),
        ("PUT", "/api/v1/streams/s", b'{"retentionTimeInMinutes": 1e400}', "application/json", 400, "invalid_policy"),
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


def _json_body_routes() -> list[tuple[str, str]]:
    document = openapi.document(make_settings(Path("unused")))
    return [
        (method.upper(), path.replace("{lid}", "1").replace("{name}", "s").replace("{cursor}", "c"))
        for path, item in document["paths"].items()
        for method, operation in item.items()
        if isinstance(operation, dict)
        and "application/json" in operation.get("requestBody", {}).get("content", {})
    ]


# Nested past the JSON decoder's recursion limit: a client's error, never the server's.
TOO_DEEP = b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


@pytest.mark.parametrize("bad", [b'{"a": ', TOO_DEEP], ids=["torn", "too_deep"])
@pytest.mark.parametrize(("method", "path"), _json_body_routes())
async def test_every_json_body_route_says_invalid_json_for_invalid_json(
    url: str, method: str, path: str, bad: bytes
) -> None:
    async with aiohttp.ClientSession() as s:
        headers = {"Content-Type": "application/json"}
        async with s.request(method, f"{url}{path}", data=bad, headers=headers) as r:
            assert r.status == 400, await r.text()
            body = await r.json()
            assert body["code"] == "invalid_json" and set(body) == {"code", "message"}
    await _still_serving(url)
