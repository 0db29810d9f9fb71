"""The fast lane (node/http/fastlane.py): adds answered from the socket, and every other
request handed, with its connection, to aiohttp. Driven over raw loopback sockets, as a
client library would hide what matters here (pipelining, partial heads and bodies, the
order of answers, when the server closes)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from node.http import models
from node.http.app import build_app
from node.http.fastlane import LEDGER_ROUTE, STREAM_ROUTE, parse_add
from node.http.state import BUDGET, METRICS
from node.wire import BATCH_CONTENT_TYPE, encode_batch
from tests.harness.rawhttp import Conn
from tests.harness.settings import make_settings

Client = TestClient[Any, Any]
TOKEN = "s3cret-token"


def _add(ledger: int | str, body: bytes, *extra: str, content_type: str = "") -> bytes:
    head = [f"POST /api/v1/ledgers/{ledger}/entries HTTP/1.1", "Host: localhost"]
    if content_type:
        head.append(f"Content-Type: {content_type}")
    head += [f"Content-Length: {len(body)}", *extra]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


Connect = Callable[[], Awaitable[Conn]]


Serve = Callable[..., Awaitable[tuple[Client, Connect]]]


@pytest.fixture
async def serve(aiohttp_client: Any, tmp_path: Path) -> AsyncIterator[Serve]:
    """A node with these settings, and raw connections to it (closed at the end)."""
    opened: list[Conn] = []

    async def start(**overrides: Any) -> tuple[Client, Connect]:
        app = build_app(make_settings(tmp_path / "d", **overrides))
        client: Client = await aiohttp_client(app)

        async def connect() -> Conn:
            opened.append(Conn(*await asyncio.open_connection(client.host, client.port)))
            return opened[-1]

        return client, connect

    yield start
    for conn in opened:
        conn.writer.close()
        with contextlib.suppress(ConnectionError):
            await conn.writer.wait_closed()


@pytest.fixture
async def node(serve: Serve) -> tuple[Client, Connect]:
    return await serve()


async def _ledger(client: Client) -> int:
    async with client.post("/api/v1/ledgers") as r:
        return int((await r.json())["ledgerId"])


def _counted(client: Client, route: str, status: int) -> float:
    """POST requests to ``route`` answered ``status``, as http_request_duration counts them."""
    labels = {"method": "POST", "route": route, "status": str(status)}
    name = "storage_node_http_request_duration_seconds_count"
    return client.app[METRICS].registry.get_sample_value(name, labels) or 0.0


# --- which requests the lane takes -----------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "route"),
    [
        (_add(7, b"x"), LEDGER_ROUTE),
        (_add(7, b"x", "X-Write-Token: t", content_type="application/octet-stream"), LEDGER_ROUTE),
        (_add(0, b"x").replace(b"ledgers/0", b"streams/orders.v1"), STREAM_ROUTE),
    ],
)
def test_plain_adds_are_the_lanes(raw: bytes, route: str) -> None:
    add = parse_add(raw, raw.index(b"\r\n\r\n"))
    assert add is not None and add.route == route and add.length == 1


@pytest.mark.parametrize(
    "raw",
    [
        _add(7, b"x").replace(b"HTTP/1.1", b"HTTP/1.0"),
        _add(7, b"x").replace(b"POST", b"PUT"),
        _add("007", b"x"),  # not canonical: aiohttp's route refuses it with invalid_id
        _add(7, b"x").replace(b"/entries", b"/entries?x=1"),
        b"POST /api/v1/streams/a%2Fb/entries HTTP/1.1\r\nContent-Length: 1\r\n\r\nx",
        _add(7, b"x", "Content-Length: 1"),  # duplicate
        _add(7, b"x", "Transfer-Encoding: chunked"),
        _add(7, b"x", "Expect: 100-continue"),
        _add(7, b"x", "Upgrade: websocket"),
        _add(7, b"x", " folded: line"),
        _add(7, b"x", "Bad Name: 1"),
        _add(7, b"x", "X-Thing: a\x01b"),
        _add(7, b"x").replace(b"Content-Length: 1", b"Content-Length: +1"),
        _add(7, b"x").replace(b"Content-Length: 1\r\n", b""),
    ],
)
def test_anything_else_goes_to_aiohttp(raw: bytes) -> None:
    assert parse_add(raw, raw.index(b"\r\n\r\n")) is None


# --- answers ---------------------------------------------------------------------------------


async def test_replies_match_the_documented_models(node: tuple[Client, Connect]) -> None:
    client, connect = node
    ledger = await _ledger(client)
    conn = await connect()
    await conn.send(_add(ledger, b"one", "X-Request-Id: abc-1"))
    status, headers, body = await conn.answer()
    assert status == 201 and headers["x-request-id"] == "abc-1"
    models.AddResult.model_validate(body)
    assert body == {"ledgerId": ledger, "entryId": 0, "lac": 0}
    await conn.send(_add(ledger, encode_batch([b"a", b"b", b"c"]), content_type=BATCH_CONTENT_TYPE))
    status, headers, body = await conn.answer()
    assert status == 201 and headers["x-request-id"]  # made by the node
    models.BatchResult.model_validate(body)
    assert body == {"ledgerId": ledger, "firstEntryId": 1, "lastEntryId": 3, "lac": 3}
    async with client.get(f"/api/v1/ledgers/{ledger}/entries/2") as r:
        assert await r.read() == b"b"
    assert _counted(client, LEDGER_ROUTE, 201) == 2


async def test_errors_are_the_routes_json_errors(node: tuple[Client, Connect]) -> None:
    client, connect = node
    ledger = await _ledger(client)
    conn = await connect()
    cases = [
        (_add(999, b"x"), 404, "ledger_not_found"),
        (_add(ledger, b"x", content_type="text/plain"), 415, "unsupported_media_type"),
        (_add(ledger, b"\0\0", content_type=BATCH_CONTENT_TYPE), 400, "invalid_frame"),
        (_add(ledger, b"", content_type=BATCH_CONTENT_TYPE), 400, "empty_batch"),
    ]
    for raw, status, code in cases:  # one connection: an error answer keeps it open
        await conn.send(raw)
        got, _headers, body = await conn.answer()
        assert (got, body["code"]) == (status, code)
        models.Error.model_validate(body)
    await conn.send(_add(ledger, b"after the errors"))
    assert (await conn.answer())[0] == 201


async def test_pipelined_requests_are_answered_in_order_across_the_hand_off(
    node: tuple[Client, Connect],
) -> None:
    """Adds, then a read (aiohttp's), then adds again, all in one write: the lane answers
    the first adds, hands the rest to aiohttp, which answers the read and the adds after."""
    client, connect = node
    ledger = await _ledger(client)
    conn = await connect()
    read = f"GET /api/v1/ledgers/{ledger}/entries/1 HTTP/1.1\r\nHost: localhost\r\n\r\n".encode()
    await conn.send(_add(ledger, b"e0") + _add(ledger, b"e1") + read + _add(ledger, b"e2"))
    answers = [await conn.answer() for _ in range(4)]
    assert [a[0] for a in answers] == [201, 201, 200, 201]
    assert [a[2]["entryId"] for a in (answers[0], answers[1], answers[3])] == [0, 1, 2]
    assert answers[2][2] == b"e1"
    # The connection stays with aiohttp and keeps working.
    await conn.send(_add(ledger, b"e3"))
    status, _headers, body = await conn.answer()
    assert status == 201 and body["entryId"] == 3
    assert _counted(client, LEDGER_ROUTE, 201) == 4  # aiohttp counts its adds the same


async def test_a_body_in_pieces_and_a_head_in_pieces(node: tuple[Client, Connect]) -> None:
    client, connect = node
    ledger = await _ledger(client)
    conn = await connect()
    payload = bytes(range(256)) * 400
    raw = _add(ledger, payload)
    for at in range(0, len(raw), 7001):
        await conn.send(raw[at : at + 7001])
        await asyncio.sleep(0.001)
    status, _headers, body = await conn.answer()
    assert status == 201
    async with client.get(f"/api/v1/ledgers/{ledger}/entries/{body['entryId']}") as r:
        assert await r.read() == payload


async def test_connection_close_is_honoured(node: tuple[Client, Connect]) -> None:
    client, connect = node
    ledger = await _ledger(client)
    conn = await connect()
    await conn.send(_add(ledger, b"x", "Connection: close"))
    status, headers, _body = await conn.answer()
    assert status == 201 and headers["connection"] == "close"
    assert await conn.closed_by_server()


async def test_a_client_that_shuts_its_side_still_gets_its_answer(
    node: tuple[Client, Connect],
) -> None:
    client, connect = node
    ledger = await _ledger(client)
    conn = await connect()
    await conn.send(_add(ledger, b"x") + _add(ledger, b"y"))
    conn.writer.write_eof()
    assert [(await conn.answer())[0] for _ in range(2)] == [201, 201]
    assert await conn.closed_by_server()


# --- refusals are aiohttp's ------------------------------------------------------------------


async def test_without_the_admin_token_aiohttp_refuses(serve: Serve) -> None:
    client, connect = await serve(admin_token=TOKEN)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with client.post("/api/v1/ledgers", headers=auth) as r:
        ledger = (await r.json())["ledgerId"]
    for header, status in [("", 401), ("Authorization: Bearer wrong", 403)]:
        conn = await connect()
        await conn.send(_add(ledger, b"x", *([header] if header else [])))
        got, _headers, body = await conn.answer()
        assert got == status and body["code"] in {"unauthorized", "forbidden"}
    conn = await connect()
    await conn.send(_add(ledger, b"x", f"Authorization: Bearer {TOKEN}"))
    assert (await conn.answer())[0] == 201
    assert _counted(client, LEDGER_ROUTE, 201) == 1


async def test_malformed_heads_get_aiohttps_400(node: tuple[Client, Connect]) -> None:
    client, connect = node
    ledger = await _ledger(client)
    conn = await connect()
    await conn.send(_add(ledger, b"x").replace(b"Content-Length: 1", b"Content-Length: 1, 2"))
    status, _headers, body = await conn.answer()
    assert status == 400 and "code" in body
    assert (await client.get(f"/api/v1/ledgers/{ledger}")).status == 200  # still serving


async def test_a_full_body_budget_sends_the_add_to_aiohttp(serve: Serve) -> None:
    """With the budget taken, the lane does not wait: aiohttp waits request_budget_wait_s
    and answers 503 with Retry-After, as for any other body."""
    client, connect = await serve(
        max_request_size=1000, max_request_bytes_in_flight=1000, request_budget_wait_s=0.2
    )
    ledger = await _ledger(client)
    holder = await connect()
    await holder.send(_add(ledger, bytes(900))[:-400])  # head and part of its body
    await asyncio.sleep(0.1)
    conn = await connect()
    await conn.send(_add(ledger, bytes(200)))
    status, headers, body = await conn.answer()
    assert (status, body["code"], headers["retry-after"]) == (503, "overloaded", "1")
    await holder.send(bytes(400))
    assert (await holder.answer())[0] == 201
    conn = await connect()
    await conn.send(_add(ledger, bytes(200)))
    assert (await conn.answer())[0] == 201


# --- timeouts ----------------------------------------------------------------------------------


async def test_a_stalled_body_gets_408_and_the_connection_closes(serve: Serve) -> None:
    client, connect = await serve(body_read_timeout_s=0.5)
    ledger = await _ledger(client)
    conn = await connect()
    await conn.send(_add(ledger, bytes(100))[:-50])
    status, _headers, body = await conn.answer()
    assert (status, body["code"]) == (408, "body_timeout")
    assert await conn.closed_by_server()
    assert client.app[BUDGET].in_use == 0  # the budget came back
    gauge = "storage_node_http_request_body_bytes_in_flight"
    assert client.app[METRICS].registry.get_sample_value(gauge) == 0


async def test_a_trickled_head_and_an_idle_connection_are_closed(serve: Serve) -> None:
    client, connect = await serve(header_timeout_s=0.5, keepalive_timeout_s=1.0)
    ledger = await _ledger(client)
    trickled = await connect()
    await trickled.send(_add(ledger, b"x")[:20])
    idle = await connect()
    await idle.send(_add(ledger, b"x"))
    assert (await idle.answer())[0] == 201
    assert await trickled.closed_by_server(within_s=3)
    assert await idle.closed_by_server(within_s=4)


# --- races ------------------------------------------------------------------------------------


async def test_concurrent_adds_on_many_connections_lose_nothing(
    node: tuple[Client, Connect],
) -> None:
    client, connect = node
    ledger = await _ledger(client)

    async def writer(n: int) -> list[int]:
        conn = await connect()
        ids = []
        for i in range(20):
            await conn.send(_add(ledger, f"{n}:{i}".encode()))
            status, _headers, body = await conn.answer()
            assert status == 201
            ids.append(body["entryId"])
        return ids

    ids = [i for batch in await asyncio.gather(*(writer(n) for n in range(16))) for i in batch]
    assert sorted(ids) == list(range(320))
    seen = set()
    for entry_id in range(320):
        async with client.get(f"/api/v1/ledgers/{ledger}/entries/{entry_id}") as r:
            seen.add(await r.read())
    assert seen == {f"{n}:{i}".encode() for n in range(16) for i in range(20)}


async def test_the_lane_can_be_turned_off(serve: Serve) -> None:
    client, connect = await serve(http_fast_lane_max_body=0)
    ledger = await _ledger(client)
    conn = await connect()
    await conn.send(_add(ledger, b"x"))
    status, headers, body = await conn.answer()
    assert status == 201 and body == {"ledgerId": ledger, "entryId": 0, "lac": 0}
    assert headers["content-type"].startswith("application/json")
