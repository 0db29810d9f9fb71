"""Replica adds on the client's own keep-alive connections (node/client/addpipe.py), against a
real node process behind a relay that sees each HTTP message: adds pipelined on one connection
get their own answers in order, errors included (the JSON code, as aiohttp's path gave it); a
connection cut in the middle of an answer fails every add not completely answered (never ok,
although the node stored it); the next add reconnects; a caller that stops waiting leaves no
answer behind for the next add to take as its own; a node that moved gets its adds at its
new address."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from node.client.bookies import UNREACHABLE, BookieClient, within
from node.client.errors import ReplicaError
from node.client.metadata.memory import MemoryStore
from node.client.model import NodeInfo, node_key
from node.client.protocol import ENTRY_CONFLICT, INVALID_LAC, WRONG_NODE
from node.client.registry import Registry
from node.localcluster import LocalCluster
from tests.client.realnodes import running_cluster
from tests.harness.cluster import until
from tests.harness.ports import free_port

LEDGER = 2**62 + 11
ONE = (1, 1, 1)
CHUNK = 65536
ANSWER_WAIT_S = 10.0  # an answer on loopback: far more than it takes


def split_messages(buffer: bytes) -> tuple[list[bytes], bytes]:
    """The complete HTTP/1.1 messages (every one with a Content-Length) at the head of
    ``buffer``, and the rest."""
    messages = []
    while (end := buffer.find(b"\r\n\r\n")) >= 0:
        length = 0
        for line in buffer[:end].split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        size = end + 4 + length
        if len(buffer) < size:
            break
        messages.append(buffer[:size])
        buffer = buffer[size:]
    return messages, buffer


class Relay:
    """A TCP relay to a node that, on its first connection only, holds the node's answers
    until ``hold_until`` requests came through (so they were pipelined) and, with
    ``cut_after``, passes that many complete answers and half of the next, then cuts both
    sides. Later connections pass everything."""

    def __init__(self, port: int, *, hold_until: int = 0, cut_after: int | None = None) -> None:
        self.port = port
        self.hold_until = hold_until
        self.cut_after = cut_after
        self.connections = 0
        self.requests: list[bytes] = []  # the first lines of the requests passed, in order
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> Relay:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*list(self._tasks), return_exceptions=True)
        await self._server.wait_closed()

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        serving = asyncio.current_task()
        assert serving is not None
        self._tasks.add(serving)
        self.connections += 1
        first = self.connections == 1
        hold = self.hold_until if first else 0
        cut = self.cut_after if first else None
        node_r, node_w = await asyncio.open_connection("127.0.0.1", self.port)
        enough = asyncio.Event()
        if not hold:
            enough.set()

        async def up() -> None:
            seen, rest = 0, b""
            while data := await client_r.read(CHUNK):
                node_w.write(data)
                messages, rest = split_messages(rest + data)
                self.requests += [m.split(b"\r\n", 1)[0] for m in messages]
                seen += len(messages)
                if seen >= hold:
                    enough.set()
            node_w.close()

        async def down() -> None:
            await enough.wait()
            passed, rest = 0, b""
            while data := await node_r.read(CHUNK):
                messages, rest = split_messages(rest + data)
                for message in messages:
                    if passed == cut:
                        client_w.write(message[: len(message) // 2])
                        await client_w.drain()
                        client_w.transport.abort()
                        node_w.transport.abort()
                        return
                    client_w.write(message)
                    passed += 1
                await client_w.drain()
            client_w.close()

        tasks = [asyncio.ensure_future(up()), asyncio.ensure_future(down())]
        self._tasks.update(tasks)
        try:
            with contextlib.suppress(ConnectionError):
                await asyncio.gather(*tasks)
        finally:
            for writer in (client_w, node_w):
                writer.transport.abort()


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[LocalCluster]:
    async with running_cluster(tmp_path / "cluster", 1) as made:
        yield made


@contextlib.asynccontextmanager
async def relayed(
    cluster: LocalCluster, **rules: int
) -> AsyncIterator[tuple[Relay, BookieClient, BookieClient]]:
    """A relay to n0 with ``rules``, a client through it with one connection per node, and
    one straight to the node (to look at what it stored)."""
    port = int(cluster.url("n0").rsplit(":", 1)[1])
    relay = await Relay(port, **rules).start()
    dead = f"http://127.0.0.1:{free_port()}"
    overrides = {"n0": relay.url, "wrong": relay.url, "dead": dead}
    through = BookieClient(Registry(MemoryStore(), overrides), connections_per_node=1)
    direct = BookieClient(Registry(MemoryStore(), {"n0": cluster.url("n0")}))
    try:
        yield relay, through, direct
    finally:
        await through.close()
        await direct.close()
        await relay.close()


async def add(
    bookie: BookieClient, entry_id: int, payload: bytes, *, lac: int = -1, node: str = "n0"
) -> None:
    await within(
        node,
        bookie.add(node, LEDGER, [(entry_id, payload)], lac=lac, lac_length=0, replication=ONE),
        ANSWER_WAIT_S,
    )


def code_of(outcome: BaseException | None) -> str | None:
    if outcome is None:
        return None
    assert isinstance(outcome, ReplicaError), repr(outcome)
    return outcome.code


async def test_pipelined_adds_get_their_own_answers_in_order(node: LocalCluster) -> None:
    async with relayed(node, hold_until=4) as (relay, through, direct):
        outcomes = await asyncio.gather(
            add(through, 0, b"zero"),
            add(through, 1, b"one", lac=5),  # a LAC past its own entry: 422 invalid_lac
            add(through, 2, b"two"),
            add(through, 0, b"not zero"),  # other bytes at a stored id: 409 entry_conflict
            return_exceptions=True,
        )
        # All four were out on one connection before the first answer came back.
        assert relay.connections == 1 and len(relay.requests) == 4
        assert [code_of(o) for o in outcomes] == [None, INVALID_LAC, None, ENTRY_CONFLICT]
        assert [o.status for o in outcomes if isinstance(o, ReplicaError)] == [422, 409]
        assert await direct.read_entry("n0", LEDGER, 0, fence=False) == b"zero"
        assert await direct.read_entry("n0", LEDGER, 2, fence=False) == b"two"
        # A node answering for another id: aiohttp's 421, then the same connection again.
        for _ in range(2):
            wrong = await asyncio.gather(
                add(through, 3, b"x", node="wrong"), return_exceptions=True
            )
            assert [code_of(o) for o in wrong] == [WRONG_NODE]
        assert relay.connections == 2
        gone = await asyncio.gather(add(through, 3, b"x", node="dead"), return_exceptions=True)
        assert [code_of(o) for o in gone] == [UNREACHABLE]


async def test_a_connection_cut_mid_answer_fails_every_add_not_answered(
    node: LocalCluster,
) -> None:
    async with relayed(node, hold_until=4, cut_after=2) as (relay, through, direct):
        outcomes = await asyncio.gather(
            *(add(through, i, b"entry-%d" % i) for i in range(4)), return_exceptions=True
        )
        assert [code_of(o) for o in outcomes] == [None, None, UNREACHABLE, UNREACHABLE]
        # The node stored the third (its answer was cut, not refused): an add that fails so
        # is unknown, never ok and never "not stored".
        for entry_id in range(4):
            stored = await direct.read_entry("n0", LEDGER, entry_id, fence=False)
            assert stored == b"entry-%d" % entry_id
        await add(through, 4, b"entry-4")  # on a new connection
        assert relay.connections == 2
        assert await direct.read_entry("n0", LEDGER, 4, fence=False) == b"entry-4"


async def test_a_caller_that_stops_waiting_leaves_no_answer_for_the_next_add(
    node: LocalCluster,
) -> None:
    async with relayed(node, hold_until=2) as (relay, through, direct):
        late = through.add("n0", LEDGER, [(0, b"late")], lac=-1, lac_length=0, replication=ONE)
        with pytest.raises(ReplicaError) as caught:
            await within("n0", late, 0.2)  # its answer is held: the caller gives up
        assert caught.value.code == "timeout"
        # The next add must not take the first one's answer when it comes: it goes on a
        # new connection, and a refusal of its own is its own.
        refused = await asyncio.gather(add(through, 0, b"other"), return_exceptions=True)
        assert [code_of(o) for o in refused] == [ENTRY_CONFLICT]
        assert relay.connections == 2
        assert await direct.read_entry("n0", LEDGER, 0, fence=False) == b"late"


async def test_a_node_that_moved_gets_its_adds_at_its_new_address(node: LocalCluster) -> None:
    port = int(node.url("n0").rsplit(":", 1)[1])
    old, new = await Relay(port).start(), await Relay(port).start()
    store = MemoryStore()
    lease = await store.grant_lease(600)
    registry = Registry(store)
    bookie = BookieClient(registry)
    try:
        await store.put(node_key("n0"), NodeInfo("n0", old.url).encode(), lease=lease)
        await add(bookie, 0, b"before the move")
        await store.put(node_key("n0"), NodeInfo("n0", new.url).encode(), lease=lease)
        await registry.nodes()  # the client learns the new address (as after a failure)
        await add(bookie, 1, b"after the move")
        assert (len(old.requests), len(new.requests)) == (1, 1)
    finally:
        await bookie.close()
        await old.close()
        await new.close()


async def test_start_add_writes_on_an_idle_connection_before_it_returns(
    node: LocalCluster,
) -> None:
    """``start_add`` sends only where it needs no wait: no connection yet, or the only one
    busy -> None (``add`` then opens or waits); an idle one -> the request written before it
    returns, its outcome (refusals included) that of ``add``. A caller that gives up on one
    (cancels it) leaves no answer behind for the next add."""

    def start(bookie: BookieClient, entry_id: int, payload: bytes, lac: int = -1) -> object:
        return bookie.start_add(
            "n0", LEDGER, [(entry_id, payload)], lac=lac, lac_length=0, replication=ONE
        )

    async with relayed(node, hold_until=2) as (relay, through, direct):
        assert start(through, 0, b"zero") is None  # no connection open yet
        first = asyncio.ensure_future(add(through, 0, b"zero"))
        await until_requests(relay, 1)
        assert start(through, 1, b"one") is None  # its connection waits for an answer
        await add(through, 1, b"one")  # the second request lets the relay pass both answers
        await first
        sent = start(through, 2, b"two")
        assert isinstance(sent, asyncio.Future)
        await until_requests(relay, 3)  # sent though nothing awaited an add
        await within("n0", sent, ANSWER_WAIT_S)
        refused = start(through, 2, b"not two")
        assert isinstance(refused, asyncio.Future)
        with pytest.raises(ReplicaError) as caught:
            await within("n0", refused, ANSWER_WAIT_S)
        assert caught.value.code == ENTRY_CONFLICT
        assert relay.connections == 1
        assert await direct.read_entry("n0", LEDGER, 2, fence=False) == b"two"
        late = start(through, 3, b"three")
        assert isinstance(late, asyncio.Future)
        late.cancel()  # before its answer could come back: its connection takes no more
        refused = await asyncio.gather(add(through, 3, b"other"), return_exceptions=True)
        assert [code_of(o) for o in refused] == [ENTRY_CONFLICT]
        assert relay.connections == 2


async def until_requests(relay: Relay, count: int) -> None:
    await until(lambda: len(relay.requests) >= count, f"{count} requests at the relay")
