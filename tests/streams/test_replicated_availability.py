"""What a replicated stream keeps serving when nodes die, at default settings, on etcd and
three node processes (the `make cluster` of the README): an acknowledged append is readable
at once through every node whatever happens to its ledger next, and a stream whose owner
died stays readable through the nodes left even when they are too few for a new ledger.
Last, an append of unknown outcome that its client retried is in the stream once."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from node.client.model import ledger_key, node_key
from node.jepsen.streams import read_back
from node.localcluster import LocalCluster
from node.settings import Settings
from node.wire import decode_stream_frames
from tests.harness.cluster import MakeCluster
from tests.harness.streams import REPLICATED, call, etcd_get, owner, put_stream, stream_ledgers

NODES = 3  # exactly a 3/3/2 ensemble: one node lost leaves too few for a new ledger
SETTLE_S = 15.0  # beyond the lease: a takeover's recovery and the first read after it
POLL_S = 0.2


@pytest.fixture
def three_nodes(make_cluster: MakeCluster) -> LocalCluster:
    """etcd and n0..n2 at default settings."""
    return make_cluster(nodes=NODES)


async def append(url: str, name: str, payload: bytes) -> tuple[int, str]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{url}/api/v1/streams/{name}/entries", data=payload) as response,
    ):
        return response.status, await response.text()


async def stream_with(c: LocalCluster, name: str, payloads: list[bytes]) -> None:
    """A 3/3/2 stream created through n0 (its owner) holding ``payloads``."""
    status, body = await put_stream(c.url("n0"), name, {"replication": REPLICATED})
    assert status == 201, body
    for payload in payloads:
        status, text = await append(c.url("n0"), name, payload)
        assert status == 201, text


async def read_all(url: str, name: str) -> tuple[int, list[tuple[str, bytes]]]:
    """One plain read of the whole (small) stream: its status and (position, payload)s."""
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{url}/api/v1/streams/{name}/entries?limit=1000") as response,
    ):
        body = await response.read()
        if response.status != 200:
            return response.status, []
        return 200, [(str(p), payload) for p, payload in decode_stream_frames(body)]


async def test_an_append_acknowledged_after_a_replica_died_reads_at_once_everywhere(
    three_nodes: LocalCluster,
) -> None:
    """The writer's ensemble change finds no replacement, so the add's outcome is settled
    by recovering the ledger (it is on two replicas: acknowledged). The owner's reads must
    take the recovered end, not its lost writer's LAC, which stops one entry short."""
    c = three_nodes
    name = "acked-after-loss"
    payloads = [b"before-%d" % i for i in range(4)]
    await stream_with(c, name, payloads)
    stream_owner = await owner(c, name)
    assert stream_owner is not None
    victim = next(n for n in c.node_ids if n != stream_owner)
    await asyncio.to_thread(c.kill, victim)

    status, text = await append(c.url(stream_owner), name, b"after-the-loss")
    assert status == 201, text
    payloads.append(b"after-the-loss")
    for node in c.node_ids:
        if node == victim:
            continue
        status, found = await read_all(c.url(node), name)
        assert status == 200
        assert [p for _, p in found] == payloads, f"read through {node}: {found}"
        cursor = await read_back(c.url(node), name, cursor=f"reader-{node}")
        assert [p for _, p in cursor] == payloads, f"cursor through {node}: {cursor}"


async def test_a_dead_owners_stream_is_taken_over_read_only_when_too_few_nodes_are_left(
    three_nodes: LocalCluster,
) -> None:
    """Three nodes, a 3/3/2 stream, its owner SIGKILLed: recovery needs only the two left,
    so the stream reads (plain reads and cursors) through both once the owner's lease ends;
    appends answer 503 not_enough_nodes; once the node is back, appends work again and
    everything reads back in order."""
    c = three_nodes
    name = "read-only-takeover"
    status, body = await put_stream(c.url("n0"), name, {"replication": REPLICATED})
    assert status == 201, body
    payloads = [b"entry-%03d" % i for i in range(300)]
    async with aiohttp.ClientSession() as session:
        for payload in payloads:
            url = f"{c.url('n0')}/api/v1/streams/{name}/entries"
            async with session.post(url, data=payload) as response:
                assert response.status == 201, await response.text()
    stream_owner = await owner(c, name)
    assert stream_owner is not None
    await asyncio.to_thread(c.kill, stream_owner)
    left = [n for n in c.node_ids if n != stream_owner]

    loop = asyncio.get_running_loop()
    deadline = loop.time() + Settings().stream_owner_ttl_s + SETTLE_S
    status, found = await read_all(c.url(left[0]), name)
    while status != 200 and loop.time() < deadline:
        await asyncio.sleep(POLL_S)
        status, found = await read_all(c.url(left[0]), name)
    assert status == 200, f"the stream is still unreadable through {left[0]}: {status}"
    for node in left:
        status, found = await read_all(c.url(node), name)
        assert status == 200 and [p for _, p in found] == payloads, (node, status, len(found))
        cursor = await read_back(c.url(node), name, cursor=f"reader-{node}")
        assert [p for _, p in cursor] == payloads, node

    # The owner's lease and the node's registration are leases of the same length, granted
    # apart: until nodes/<id> is gone, a new ledger may still name the dead node (its add
    # then acknowledged by the two left, as a bookie whose session has not expired yet).
    deadline = loop.time() + Settings().registration_ttl_s + SETTLE_S
    while await etcd_get(c, node_key(stream_owner)) is not None:
        assert loop.time() < deadline, f"nodes/{stream_owner} outlived its lease"
        await asyncio.sleep(POLL_S)
    status, text = await append(c.url(left[1]), name, b"too-few-nodes")
    assert status == 503 and '"not_enough_nodes"' in text, (status, text)
    ledgers = await stream_ledgers(c, name)
    assert ledgers[-1]["closed"] and ledgers[-1]["entries"] == len(payloads), ledgers

    await asyncio.to_thread(c.start, stream_owner)
    deadline = loop.time() + SETTLE_S
    status, text = await append(c.url(left[1]), name, b"nodes-are-back")
    while status != 201 and loop.time() < deadline:
        await asyncio.sleep(POLL_S)
        status, text = await append(c.url(left[1]), name, b"nodes-are-back")
    assert status == 201, text
    status, found = await call("GET", f"{c.url(stream_owner)}/api/v1/streams/{name}")
    assert status == 200 and found["entries"] == len(payloads) + 1, found
    cursor = await read_back(c.url(stream_owner), name, cursor="after")
    assert [p for _, p in cursor] == [*payloads, b"nodes-are-back"]


@pytest.fixture
def four_nodes(make_cluster: MakeCluster) -> LocalCluster:
    """etcd and n0..n3, with an owner lease long enough to outlast an etcd outage of the
    test (the owner keeps its streams through it)."""
    return make_cluster(nodes=4, env={"NODE_STREAM_OWNER_TTL_S": str(LONG_LEASE_S)})


LONG_LEASE_S = 60


async def test_an_append_of_unknown_outcome_retried_after_reading_is_never_kept_twice(
    four_nodes: LocalCluster,
) -> None:
    """With etcd down and a replica dead, append X's outcome is unknown (it is on two
    replicas, the writer could not change its ensemble). The client reads the stream, does
    not see X and appends it again once the store is back. The ledger holding the first X
    must be closed at the end the stream showed before anything goes past it: else a later
    takeover recovers the first X behind the second (behind positions readers consumed)."""
    c = four_nodes
    name = "unknown-then-retried"
    await stream_with(c, name, [b"a%d" % i for i in range(3)])
    ledger = (await stream_ledgers(c, name))[-1]["id"]
    ensemble = (await etcd_get(c, ledger_key(ledger)))["segments"][-1]["ensemble"]
    victim = next(n for n in ensemble if n != "n0")
    await asyncio.to_thread(c.kill, victim)
    await asyncio.to_thread(c.kill_etcd)

    status, text = await append(c.url("n0"), name, b"X")
    assert status == 503 and '"append_outcome_unknown"' in text, (status, text)
    status, found = await read_all(c.url("n0"), name)
    assert status == 200 and [p for _, p in found] == [b"a0", b"a1", b"a2"], found

    status, text = await append(c.url("n0"), name, b"X")  # the store is still down
    assert status == 503, text
    await asyncio.to_thread(c.restart_etcd)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SETTLE_S
    status, text = await append(c.url("n0"), name, b"X")
    while status != 201 and loop.time() < deadline:
        await asyncio.sleep(POLL_S)
        status, text = await append(c.url("n0"), name, b"X")
    assert status == 201, text

    await asyncio.to_thread(c.start, victim)  # the first X is readable on two replicas again
    await asyncio.to_thread(c.terminate, "n0")  # n1 takes the stream over, recovering ledgers
    found_back = await read_back(c.url("n1"), name)
    assert [p for _, p in found_back] == [b"a0", b"a1", b"a2", b"X"], found_back


@pytest.fixture
def four_default_nodes(make_cluster: MakeCluster) -> LocalCluster:
    return make_cluster(nodes=4)


TAKEOVER_SLACK_S = 6.0  # past the lease: noticing it ended (a third of it), the takeover


async def test_appends_through_another_node_work_again_soon_after_a_paused_owners_lease(
    four_default_nodes: LocalCluster,
) -> None:
    """The owner SIGSTOPped: a request forwarded to it waits while it is the owner, and no
    longer (not the forward timeout): once its lease ends the append answers 503 and the next
    one takes the stream over, within the lease and a few seconds, at default settings."""
    c = four_default_nodes
    name = "paused-owner"
    await stream_with(c, name, [b"before-%d" % i for i in range(5)])
    stream_owner = await owner(c, name)
    assert stream_owner is not None
    other = next(n for n in c.node_ids if n != stream_owner)
    loop = asyncio.get_running_loop()
    c.stop(stream_owner)
    try:
        paused_at = loop.time()
        limit = Settings().stream_owner_ttl_s + TAKEOVER_SLACK_S
        answers = []
        status = 0
        while status != 201 and loop.time() - paused_at < 2 * limit:
            status, text = await append(c.url(other), name, b"after")
            answers.append((round(loop.time() - paused_at, 1), status, text[:80]))
        took = loop.time() - paused_at
        assert status == 201 and took < limit, answers
    finally:
        c.cont(stream_owner)
    found = await read_back(c.url(other), name)
    assert [p for _, p in found][:5] == [b"before-%d" % i for i in range(5)]
    assert [p for _, p in found].count(b"after") >= 1
