"""The fault proxy between a client and a node, over real loopback sockets: each rule does to
the bytes what it says, in each direction, and switches while connections are open."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from node.jepsen.proxy import DROP, RESET, Direction, Proxy, ProxyMesh

SETTLE_S = 0.2  # long enough for bytes that would flow to have flowed on loopback
DELAY_S = 0.3


class Upstream:
    """A server that records what it received and echoes each chunk back."""

    def __init__(self) -> None:
        self.received = bytearray()
        self.server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(1024):
                self.received += data
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        writer.close()

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    server = Upstream()
    await server.start()
    yield server
    await server.close()


@pytest.fixture
async def proxy(upstream: Upstream) -> AsyncIterator[Proxy]:
    made = await Proxy("127.0.0.1", upstream.port, "test").start()
    yield made
    await made.close()


async def connect(proxy: Proxy) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", proxy.port)


async def test_pass_forwards_both_ways_and_counts(proxy: Proxy, upstream: Upstream) -> None:
    reader, writer = await connect(proxy)
    writer.write(b"GET /x HTTP/1.1\r\n\r\n")
    assert await asyncio.wait_for(reader.readexactly(19), 5) == b"GET /x HTTP/1.1\r\n\r\n"
    writer.close()
    assert proxy.counters.connections == 1
    assert proxy.counters.received[Direction.UP] == 19
    assert proxy.counters.delivered[Direction.DOWN] == 19
    assert proxy.counters.requests == ["GET /x HTTP/1.1"]


async def test_delay_delivers_late_in_order(proxy: Proxy) -> None:
    proxy.delay(DELAY_S, Direction.UP)
    reader, writer = await connect(proxy)
    loop = asyncio.get_running_loop()
    started = loop.time()
    writer.write(b"one")
    await asyncio.sleep(0.05)
    writer.write(b"two")
    assert await asyncio.wait_for(reader.readexactly(6), 5) == b"onetwo"
    assert loop.time() - started >= DELAY_S
    writer.close()


async def test_hold_up_keeps_the_request_from_the_node_until_release(
    proxy: Proxy, upstream: Upstream
) -> None:
    reader, writer = await connect(proxy)
    proxy.hold(Direction.UP)
    writer.write(b"first")
    writer.write(b"second")
    await asyncio.sleep(SETTLE_S)
    assert upstream.received == b""
    proxy.release()
    assert await asyncio.wait_for(reader.readexactly(11), 5) == b"firstsecond"
    assert upstream.received == b"firstsecond"
    writer.close()


async def test_hold_down_lets_the_node_act_but_hides_its_answer(
    proxy: Proxy, upstream: Upstream
) -> None:
    reader, writer = await connect(proxy)
    proxy.hold(Direction.DOWN)
    writer.write(b"add")
    await asyncio.sleep(SETTLE_S)
    assert upstream.received == b"add"  # the node did it ...
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(reader.readexactly(3), SETTLE_S)  # ... the client does not know
    proxy.release(Direction.DOWN)
    assert await asyncio.wait_for(reader.readexactly(3), 5) == b"add"
    writer.close()


async def test_drop_loses_bytes_and_healing_resets_the_broken_connection(
    proxy: Proxy, upstream: Upstream
) -> None:
    reader, writer = await connect(proxy)
    proxy.drop()
    writer.write(b"lost")
    await asyncio.sleep(SETTLE_S)
    assert upstream.received == b""
    assert proxy.counters.dropped[Direction.UP] == 4
    proxy.heal()
    with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
        await asyncio.wait_for(reader.readexactly(1), 5)
    assert proxy.counters.resets == 1
    # a new connection after healing flows
    reader, writer = await connect(proxy)
    writer.write(b"ok")
    assert await asyncio.wait_for(reader.readexactly(2), 5) == b"ok"
    writer.close()


async def test_reset_breaks_open_connections_and_refuses_new_ones(
    proxy: Proxy, upstream: Upstream
) -> None:
    reader, writer = await connect(proxy)
    writer.write(b"a")
    assert await asyncio.wait_for(reader.readexactly(1), 5) == b"a"
    proxy.set(RESET)
    with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
        await asyncio.wait_for(reader.readexactly(1), 5)
    reader, writer = await connect(proxy)
    with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
        writer.write(b"b")
        await asyncio.wait_for(reader.readexactly(1), 5)
    proxy.heal()
    reader, writer = await connect(proxy)
    writer.write(b"c")
    assert await asyncio.wait_for(reader.readexactly(1), 5) == b"c"
    writer.close()


async def test_a_node_that_is_down_looks_reset(upstream: Upstream) -> None:
    port = upstream.port
    await upstream.close()
    proxy = await Proxy("127.0.0.1", port).start()
    try:
        reader, writer = await connect(proxy)
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            writer.write(b"x")
            await asyncio.wait_for(reader.readexactly(1), 5)
    finally:
        await proxy.close()


async def test_mesh_gives_each_client_its_own_way_to_each_node(upstream: Upstream) -> None:
    mesh = ProxyMesh({"n0": f"http://127.0.0.1:{upstream.port}"})
    try:
        writer_side = await mesh.for_client("w")
        reader_side = await mesh.for_client("r")
        assert writer_side.keys() == reader_side.keys() == {"n0"}
        assert writer_side["n0"] != reader_side["n0"]
        mesh["w", "n0"].hold(Direction.UP)
        r, w = await connect(mesh["r", "n0"])
        w.write(b"r")
        assert await asyncio.wait_for(r.readexactly(1), 5) == b"r"  # r's way is not held
        w.close()
        assert len(mesh.to_node("n0")) == 2
    finally:
        await mesh.close()


async def test_healing_may_leave_a_cut_connection_cut_while_new_ones_pass(
    proxy: Proxy, upstream: Upstream
) -> None:
    """The request in flight during a partition never arrives, not even later, and its
    connection is not reset (a client would retry on a reset); new connections flow."""
    reader, writer = await connect(proxy)
    proxy.drop()
    writer.write(b"fence")
    await asyncio.sleep(SETTLE_S)
    proxy.heal(keep_cut=True)
    writer.write(b"more")
    fresh_reader, fresh_writer = await connect(proxy)
    fresh_writer.write(b"read")
    assert await asyncio.wait_for(fresh_reader.readexactly(4), 5) == b"read"
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(reader.readexactly(1), SETTLE_S)
    assert upstream.received == b"read"
    assert proxy.counters.resets == 0
    writer.close()
    fresh_writer.close()


async def test_a_rule_armed_on_a_request_catches_exactly_its_answer(
    proxy: Proxy, upstream: Upstream
) -> None:
    """The request that matches goes through; its answer, and what follows, is dropped."""
    reader, writer = await connect(proxy)
    proxy.on_request("POST /v3/kv/txn", DROP, Direction.DOWN)
    read = b"POST /v3/kv/range HTTP/1.1\r\n"
    writer.write(read)
    assert await asyncio.wait_for(reader.readexactly(len(read)), 5) == read
    assert not proxy.triggered.is_set()
    writer.write(b"POST /v3/kv/txn HTTP/1.1\r\n")
    await asyncio.wait_for(proxy.triggered.wait(), 5)
    await asyncio.sleep(SETTLE_S)
    assert upstream.received.endswith(b"POST /v3/kv/txn HTTP/1.1\r\n")
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(reader.readexactly(1), SETTLE_S)
    writer.close()
