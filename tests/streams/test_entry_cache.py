"""The owner's entry cache of replicated streams (node/streams/cache.py): bounded by bytes,
emptied behind the slowest cursor; on etcd and three node processes at default settings, a
tailing cursor is answered from it and a catch-up read goes to the replicas."""

from __future__ import annotations

import aiohttp
import pytest

from node.jepsen.streams import read_back
from node.localcluster import LocalCluster
from node.streams.cache import EntryCache
from node.wire import decode_stream_frames
from tests.harness.cluster import MakeCluster
from tests.harness.metrics import parse_samples
from tests.harness.streams import REPLICATED, call, owner, put_stream

HITS = ("storage_node_stream_entry_cache_hits_total", ())
MISSES = ("storage_node_stream_entry_cache_misses_total", ())
CACHED = ("storage_node_stream_entry_cache_bytes", ())


def test_the_cache_keeps_the_newest_entries_within_its_bytes() -> None:
    cache = EntryCache(max_bytes=10)
    cache.put(1, 0, [b"aaaa", b"bbbb"])
    cache.put(2, 0, [b"cccc"])  # 12 bytes: the oldest entry goes
    assert cache.get(1, 0) is None and cache.get(1, 1) == b"bbbb" and cache.get(2, 0) == b"cccc"
    assert cache.size_bytes == 8 and cache.stats.evicted == 1
    cache.drop_through(1, 1)
    assert cache.get(1, 1) is None and cache.size_bytes == 4
    cache.drop_ledgers({2})
    assert len(cache) == 0 and cache.size_bytes == 0


def test_entries_read_ahead_behind_the_cached_ones_go_with_the_cursors_prefix() -> None:
    """A read-ahead may put entries below those cached (a catch-up behind a writer's tail):
    ids stay in order, so a cursor's acknowledgment drops them too, and the oldest are the
    first evicted."""
    cache = EntryCache(max_bytes=100)
    cache.put(7, 10, [b"k", b"l"])
    cache.put(7, 0, [b"a", b"b", b"c"])  # behind: merged in id order
    cache.put(7, 11, [b"L", b"m"])  # 11 is cached already: only 12 goes in
    assert [cache.get(7, i) for i in (0, 2, 10, 11, 12)] == [b"a", b"c", b"k", b"l", b"m"]
    assert (len(cache), cache.size_bytes) == (6, 6)
    cache.drop_through(7, 5)
    assert (len(cache), cache.size_bytes) == (3, 3) and cache.get(7, 0) is None
    cache.max_bytes = 2
    cache.put(8, 0, [b"z"])  # the oldest of ledger 7 make room
    assert [cache.get(7, i) for i in (10, 11, 12)] == [None, None, b"m"]
    cache.drop_through(7, 12)
    assert (len(cache), cache.size_bytes, cache.get(8, 0)) == (1, 1, b"z")


def test_a_cache_of_no_bytes_keeps_nothing() -> None:
    cache = EntryCache(max_bytes=0)
    cache.put(1, 0, [b"x"])
    assert cache.get(1, 0) is None and len(cache) == 0


@pytest.fixture
def three_nodes(make_cluster: MakeCluster) -> LocalCluster:
    return make_cluster(nodes=3)


async def metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as response:
        return parse_samples(await response.text())


async def test_a_tailing_cursor_reads_from_the_owners_cache_and_catch_up_from_replicas(
    three_nodes: LocalCluster,
) -> None:
    c = three_nodes
    name = "tailing"
    status, body = await put_stream(c.url("n0"), name, {"replication": REPLICATED})
    assert status == 201, body
    owner_url = c.url(str(await owner(c, name)))
    cursor = f"{owner_url}/api/v1/streams/{name}/cursors/tail"
    status, body = await call("PUT", cursor, {"start": "latest"})
    assert status in (200, 201), body
    payloads = [b"tail-%03d" % i for i in range(50)]
    async with aiohttp.ClientSession() as session:
        for payload in payloads:
            url = f"{owner_url}/api/v1/streams/{name}/entries"
            async with session.post(url, data=payload) as response:
                assert response.status == 201
    before = await metrics(owner_url)
    found = await read_back(owner_url, name, cursor="tail")
    assert [p for _, p in found] == payloads
    after = await metrics(owner_url)
    assert after[HITS] - before[HITS] == len(payloads)
    assert after[MISSES] == before[MISSES]
    # Every cursor acknowledged every entry: nothing is kept for them any more.
    assert after[CACHED] == 0

    # So a new cursor from the earliest entry reads the replicas: the same bytes.
    await call("DELETE", cursor)
    replay = await read_back(owner_url, name, cursor="replay")
    assert [p for _, p in replay] == payloads
    assert (await metrics(owner_url))[MISSES] - after[MISSES] == len(payloads)

    # A reader catching up page by page: each page that went to the replicas fetches the
    # next one into the cache meanwhile (read-ahead), so the next page is answered from it.
    page = 10
    before = await metrics(owner_url)
    async with aiohttp.ClientSession() as session:
        url = f"{owner_url}/api/v1/streams/{name}/entries?limit={page}"
        async with session.get(url) as response:
            assert response.status == 200
            following = response.headers["X-Next-Position"]
        middle = await metrics(owner_url)
        async with session.get(f"{url}&from={following}") as response:
            assert response.status == 200
            second = decode_stream_frames(await response.read())
    after = await metrics(owner_url)
    assert [p for _, p in second] == payloads[page : 2 * page]
    assert middle[MISSES] - before[MISSES] == page
    assert after[HITS] - middle[HITS] == page and after[MISSES] == middle[MISSES]
