"""max_connections: a connection past it gets 503 too_many_connections and is closed, the
connections already open go on, and the place of one that closes is free again; a long poll
whose client hangs up ends at once and gives its place back. Small bounds here (a few raw
connections); tests/http/test_descriptors.py floods a node with the shipped bound."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from node.http.app import build_app
from tests.harness.settings import make_settings
from tests.http.test_descriptors import samples

HEARTBEAT = b"GET /heartbeat HTTP/1.1\r\nHost: localhost\r\n\r\n"
LEDGERS = b"GET /api/v1/ledgers HTTP/1.1\r\nHost: localhost\r\n\r\n"
HANGUP_BOUND_S = 5.0  # a hung-up long poll's place is free within this


class Raw:
    """One keep-alive connection, on raw bytes."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, client: Any) -> Raw:
        return cls(*await asyncio.open_connection(client.server.host, client.server.port))

    async def ask(self, request: bytes) -> tuple[bytes, bytes]:
        """The head and body of the answer to ``request``."""
        self.writer.write(request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        return head, await self.reader.readexactly(length)

    async def metrics(self) -> dict[str, float]:
        _, body = await self.ask(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n")
        return samples(body.decode())

    def close(self) -> None:
        self.writer.close()


async def _node(tmp_path: Path, aiohttp_client: Any, max_connections: int) -> Any:
    settings = make_settings(tmp_path / "data", max_connections=max_connections)
    return await aiohttp_client(build_app(settings))


async def test_a_connection_past_max_connections_gets_503_and_is_closed(
    tmp_path: Path, aiohttp_client: Any
) -> None:
    client = await _node(tmp_path, aiohttp_client, max_connections=3)
    opened = [await Raw.open(client) for _ in range(3)]
    for raw in opened:
        head, _ = await raw.ask(HEARTBEAT)
        assert head.startswith(b"HTTP/1.1 200")
    refused = await Raw.open(client)
    head, body = await refused.ask(LEDGERS)
    assert head.startswith(b"HTTP/1.1 503")
    assert b"\r\nRetry-After: 1\r\n" in head and b"\r\nConnection: close\r\n" in head
    assert json.loads(body)["code"] == "too_many_connections"
    assert await refused.reader.read() == b""  # closed by the node
    refused.close()
    # The liveness probe's heartbeat is answered all the same (then closed).
    probe = await Raw.open(client)
    head, body = await probe.ask(HEARTBEAT)
    assert head.startswith(b"HTTP/1.1 200") and body == b"OK\n"
    assert await probe.reader.read() == b""
    probe.close()
    # The connections already open go on.
    metrics = await opened[0].metrics()
    assert metrics["storage_node_http_connections"] == 3
    assert metrics["storage_node_http_refused_connections_total"] == 2
    assert metrics["storage_node_http_max_connections"] == 3
    # One closes: its place is free.
    opened.pop().close()
    for _ in range(50):
        if (await opened[0].metrics())["storage_node_http_connections"] == 2:
            break
        await asyncio.sleep(0.1)
    again = await Raw.open(client)
    head, _ = await again.ask(HEARTBEAT)
    assert head.startswith(b"HTTP/1.1 200")
    for raw in [*opened, again]:
        raw.close()


async def test_a_long_poll_whose_client_hangs_up_gives_its_place_back(
    tmp_path: Path, aiohttp_client: Any
) -> None:
    client = await _node(tmp_path, aiohttp_client, max_connections=2)
    scrape = await Raw.open(client)
    head, body = await scrape.ask(
        b"POST /api/v1/ledgers HTTP/1.1\r\nHost: localhost\r\nContent-Length: 0\r\n\r\n"
    )
    ledger_id = json.loads(body)["ledgerId"]
    poll = await Raw.open(client)
    poll.writer.write(
        b"GET /api/v1/ledgers/%d/lac?after=0&timeoutMs=60000 HTTP/1.1\r\nHost: localhost\r\n\r\n"
        % ledger_id
    )
    for _ in range(50):
        if (await scrape.metrics())["storage_node_lac_long_polls"] == 1:
            break
        await asyncio.sleep(0.1)
    assert (await scrape.metrics())["storage_node_http_connections"] == 2
    poll.close()  # the client hangs up 60 s before the poll's timeout
    deadline = asyncio.get_running_loop().time() + HANGUP_BOUND_S
    while asyncio.get_running_loop().time() < deadline:
        metrics = await scrape.metrics()
        # The connection goes first; the cancelled handler then forgets its waiter.
        if (
            metrics["storage_node_http_connections"] == 1
            and not metrics["storage_node_lac_long_polls"]
        ):
            break
        await asyncio.sleep(0.1)
    assert metrics["storage_node_http_connections"] == 1
    assert metrics["storage_node_lac_long_polls"] == 0
    route = '{method="GET",route="/api/v1/ledgers/{lid}/lac",status="499"}'
    assert metrics.get(f"storage_node_http_request_duration_seconds_count{route}") == 1, [
        k for k in metrics if "lac" in k and "_count" in k
    ]
    fresh = await Raw.open(client)
    head, _ = await fresh.ask(HEARTBEAT)
    assert head.startswith(b"HTTP/1.1 200")
    fresh.close()
    scrape.close()
