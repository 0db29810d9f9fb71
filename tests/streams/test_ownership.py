"""Stream ownership (node/streams/ownership.py) with two "nodes" (two Ownership objects) on one
metadata store: the real etcd and the in-memory twin (``store``), or an etcd of the test's own
that it pauses. A node cut from the store (``Partition``) is what a paused, partitioned or
crashed owner looks like from etcd: no keepalive arrives."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, cast

import pytest

from node.client.errors import CasConflict, StoreUnavailable
from node.client.metadata.etcd import EtcdStore
from node.client.metadata.store import MetadataStore
from node.settings import Settings
from node.streams.ownership import NotOwner, Owner, OwnerFormatError, Ownership, owner_key
from tests.harness.etcd import EtcdServer

TTL_S = 2  # etcd's minimum lease TTL with its default election timeout (shorter is rounded up)
SLACK_S = 2.0  # etcd checks for expired leases every 0.5 s; a loaded machine adds more
POLL_S = 0.05


class Partition:
    """A node's way to the store, which the test cuts: every call fails as if etcd were away."""

    def __init__(self, store: MetadataStore) -> None:
        self.store = store
        self.cut = False

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.store, name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            if self.cut:
                raise StoreUnavailable(f"{name}: partitioned by the test")
            return await method(*args, **kwargs)

        return call


class Node:
    """One node's Ownership, through a partition the test may cut, recording on_lost."""

    def __init__(self, store: MetadataStore, node_id: str, ttl_s: int = TTL_S) -> None:
        self.partition = Partition(store)
        self.lost: list[tuple[float, list[str]]] = []
        self.any_lost = asyncio.Event()
        self.ownership = Ownership(
            cast(MetadataStore, self.partition),
            node_id,
            f"http://{node_id}.test:8080",
            ttl_s,
            clock_ms=lambda: 1_700_000_000_000,
            on_lost=self._on_lost,
        )

    def _on_lost(self, names: list[str]) -> None:
        self.lost.append((time.monotonic(), names))
        self.any_lost.set()


@pytest.fixture
async def nodes(store: MetadataStore) -> AsyncIterator[Callable[..., Awaitable[Node]]]:
    started: list[Node] = []

    async def start(node_id: str, ttl_s: int = TTL_S) -> Node:
        node = Node(store, node_id, ttl_s)
        await node.ownership.start()
        started.append(node)
        return node

    yield start
    for node in started:
        await node.ownership.stop()


async def _acquire_within(ownership: Ownership, name: str, within_s: float) -> int:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        revision = await ownership.acquire(name)
        if revision is not None:
            return revision
        await asyncio.sleep(POLL_S)
    raise AssertionError(f"{ownership.node_id} could not acquire {name} in {within_s} s")


async def test_one_node_owns_and_the_other_sees_it(
    store: MetadataStore, nodes: Callable[..., Awaitable[Node]]
) -> None:
    a, b = await nodes("a"), await nodes("b")
    revision = await a.ownership.acquire("s")
    assert revision is not None
    assert await b.ownership.acquire("s") is None
    assert await b.ownership.owner("s") == Owner(
        "a", "http://a.test:8080", 1_700_000_000_000, revision
    )
    assert await a.ownership.acquire("s") == revision  # owned already: the same guard
    assert a.ownership.owned == {"s": revision}
    assert a.ownership.guard("s") == {"stream-owners/s": revision}
    with pytest.raises(NotOwner, match="stream s: not owned by this node"):
        b.ownership.guard("s")
    with pytest.raises(KeyError):
        b.ownership.guard("s")
    assert (a.ownership.takeovers, b.ownership.takeovers) == (1, 0)
    assert await b.ownership.owner("other") is None
    # the owner's writes pass its guard; another's guard does not exist
    await store.commit(a.ownership.guard("s"), {"streams/s": b"record"})


async def test_a_stopped_owner_frees_its_streams_at_once(
    store: MetadataStore, nodes: Callable[..., Awaitable[Node]]
) -> None:
    a, b = await nodes("a"), await nodes("b")
    first = await a.ownership.acquire("s1")
    assert first is not None and await a.ownership.acquire("s2") is not None
    await a.ownership.stop()
    assert a.ownership.owned == {}
    # no waiting for a TTL: the revoke deleted the keys
    taken = await b.ownership.acquire("s1")
    assert taken is not None and taken > first
    assert await b.ownership.acquire("s2") is not None
    assert a.lost == []  # a stop is no loss
    with pytest.raises(CasConflict):
        await store.commit({owner_key("s1"): first}, {"streams/s1": b"stale"})


async def test_a_cut_off_owner_gives_up_before_another_takes_over(
    store: MetadataStore, nodes: Callable[..., Awaitable[Node]]
) -> None:
    """A keeps no lease alive (paused, partitioned): once the lease ends, B acquires; A's
    on_lost fires by its own clock, no later than B's takeover; A's guard writes nothing."""
    a, b = await nodes("a"), await nodes("b")
    guard_s1 = await a.ownership.acquire("s1")
    assert guard_s1 is not None and await a.ownership.acquire("s2") is not None
    old_guard = a.ownership.guard("s1")
    a.partition.cut = True
    cut_at = time.monotonic()
    taken = await _acquire_within(b.ownership, "s1", TTL_S + SLACK_S)
    taken_at = time.monotonic()
    assert taken_at - cut_at >= TTL_S - TTL_S / 3 - POLL_S  # not before A's lease could end
    # By A's clock at the latest when the lease ends (the in-memory twin ends it at that very
    # instant: B's poll may run first by a hair, before A's timer has; etcd ends it later).
    await asyncio.wait_for(a.any_lost.wait(), SLACK_S)
    assert [names for _, names in a.lost] == [["s1", "s2"]]
    assert a.lost[0][0] <= taken_at + POLL_S
    assert a.ownership.owned == {}
    with pytest.raises(NotOwner):
        a.ownership.guard("s1")
    with pytest.raises(CasConflict) as refused:
        await store.commit(old_guard, {"streams/s1": b"from the old owner"})
    assert refused.value.current is not None and refused.value.current.revision == taken
    assert await store.get("streams/s1") is None
    # healed: A sees B's stream as B's, and acquires others under a new lease
    a.partition.cut = False
    assert await a.ownership.acquire("s1") is None
    assert await _acquire_within(a.ownership, "s3", SLACK_S) > taken


async def test_keepalives_hold_ownership_over_several_ttls(
    nodes: Callable[..., Awaitable[Node]],
) -> None:
    a, b = await nodes("a"), await nodes("b")
    revision = await a.ownership.acquire("s")
    deadline = time.monotonic() + 3 * TTL_S
    while time.monotonic() < deadline:
        assert await b.ownership.acquire("s") is None
        await asyncio.sleep(0.25)
    assert a.ownership.owned == {"s": revision} and a.lost == []


async def test_concurrent_acquires_make_one_owner(
    nodes: Callable[..., Awaitable[Node]],
) -> None:
    a, b = await nodes("a"), await nodes("b")
    results = await asyncio.gather(
        *(n.ownership.acquire(name) for name in ["s1", "s2", "s3"] for n in [a, b, a, b])
    )
    for i, name in enumerate(["s1", "s2", "s3"]):
        a1, b1, a2, b2 = results[4 * i : 4 * i + 4]
        assert a1 == a2 and b1 == b2  # one node's concurrent acquires agree
        assert (a1 is None) != (b1 is None), (name, results)
        winner = a if a1 is not None else b
        assert winner.ownership.owned[name] == (a1 or b1)
    assert a.ownership.takeovers + b.ownership.takeovers == 3


async def test_release_deletes_only_its_own_key(
    store: MetadataStore, nodes: Callable[..., Awaitable[Node]]
) -> None:
    a, b = await nodes("a"), await nodes("b")
    assert await a.ownership.acquire("s") is not None
    await a.ownership.release("s")
    assert a.ownership.owned == {} and await store.get(owner_key("s")) is None
    await a.ownership.release("s")  # not owned: nothing to do
    # A still believes it owns t when its key was replaced: its release leaves B's key alone
    stale = await a.ownership.acquire("t")
    assert stale is not None
    await store.commit({owner_key("t"): stale}, {owner_key("t"): None})
    taken = await b.ownership.acquire("t")
    await a.ownership.release("t")
    owner = await store.get(owner_key("t"))
    assert owner is not None and owner.revision == taken
    assert a.lost == []


async def test_a_release_the_store_misses_is_done_at_a_later_keepalive(
    store: MetadataStore, nodes: Callable[..., Awaitable[Node]]
) -> None:
    a, b = await nodes("a"), await nodes("b")
    assert await a.ownership.acquire("s") is not None
    a.partition.cut = True
    await a.ownership.release("s")
    assert a.ownership.owned == {}
    assert await b.ownership.acquire("s") is None  # the key stays, under A's live lease
    a.partition.cut = False
    assert await _acquire_within(b.ownership, "s", TTL_S) is not None  # a keepalive away
    assert a.lost == []


async def test_a_lost_guard_drops_that_stream_only(
    store: MetadataStore, nodes: Callable[..., Awaitable[Node]]
) -> None:
    a = await nodes("a")
    s1 = await a.ownership.acquire("s1")
    s2 = await a.ownership.acquire("s2")
    assert s1 is not None and s2 is not None
    await store.commit({}, {owner_key("s1"): None})  # as an operator's delete would
    with pytest.raises(CasConflict) as refused:
        await store.commit(a.ownership.guard("s1"), {"streams/s1": b"record"})
    assert refused.value.key == owner_key("s1")
    a.ownership.lost("s1")
    a.ownership.lost("s1")  # once only
    assert [names for _, names in a.lost] == [["s1"]]
    assert a.ownership.owned == {"s2": s2}


async def test_a_restarted_node_takes_its_own_key_over_at_once(
    store: MetadataStore, nodes: Callable[..., Awaitable[Node]]
) -> None:
    """A node that crashed leaves its keys under a lease nobody keeps; started again (same id),
    it need not wait for that lease: it replaces its own key and takes the stream over."""
    before = await nodes("a")
    old = await before.ownership.acquire("s")
    assert old is not None
    before.partition.cut = True  # the old process is gone
    after = await nodes("a")
    assert (await after.ownership.owner("s")) is not None
    taken = await after.ownership.acquire("s")
    assert taken is not None and taken > old
    assert after.ownership.takeovers == 1
    with pytest.raises(CasConflict):
        await store.commit({owner_key("s"): old}, {"streams/s": b"from the old process"})


async def test_an_etcd_outage_shorter_than_the_ttl_loses_nothing(own_etcd: EtcdServer) -> None:
    """A keepalive fails (etcd paused: it accepts and never answers), the next ones, after
    the outage, hold the lease: no stream is dropped."""
    ttl_s = 6  # keepalives every 2 s, each failing in 0.5 s: the outage ends 1.5 s at least
    # before the lease's deadline, however the ticks fall
    store = EtcdStore(own_etcd.url(f"outage-{uuid.uuid4().hex[:8]}"), timeout_s=0.5)
    node = Node(store, "a", ttl_s)
    try:
        await node.ownership.start()
        revision = await node.ownership.acquire("s")
        assert revision is not None
        own_etcd.pause()
        try:
            paused_at = time.monotonic()
            while node.ownership.last_error is None:
                assert time.monotonic() - paused_at < ttl_s / 3 + 1.0, "no keepalive failed"
                await asyncio.sleep(POLL_S)
        finally:
            own_etcd.resume()
        assert "StoreUnavailable" in node.ownership.last_error
        await asyncio.sleep(ttl_s)  # past the TTL: the keepalives after the outage held it
        assert node.ownership.owned == {"s": revision} and node.lost == []
        assert node.ownership.last_error is None
        await store.commit(node.ownership.guard("s"), {"streams/s": b"record"})
    finally:
        await node.ownership.stop()
        await store.close()


async def test_an_etcd_outage_past_the_ttl_drops_every_stream_before_etcd_returns(
    own_etcd: EtcdServer,
) -> None:
    ttl_s = 2
    store = EtcdStore(own_etcd.url(f"outage-{uuid.uuid4().hex[:8]}"), timeout_s=1.0)
    node = Node(store, "a", ttl_s)
    try:
        await node.ownership.start()
        old = await node.ownership.acquire("s1")
        assert old is not None and await node.ownership.acquire("s2") is not None
        own_etcd.pause()
        paused_at = time.monotonic()
        try:
            await asyncio.wait_for(node.any_lost.wait(), ttl_s + SLACK_S)
            # the safe rule: given up by the node's own clock, while etcd still says nothing
            assert [names for _, names in node.lost] == [["s1", "s2"]]
            assert node.lost[0][0] - paused_at <= ttl_s + 0.5
        finally:
            own_etcd.resume()
        # etcd may not have ended the lease yet: the node replaces its own key then
        again = await _acquire_within(node.ownership, "s1", SLACK_S)
        assert again > old
        with pytest.raises(CasConflict):
            await store.commit({owner_key("s1"): old}, {"streams/s1": b"stale"})
    finally:
        await node.ownership.stop()
        await store.close()


async def test_the_default_ttl_frees_a_dead_owners_streams_after_ten_seconds(
    etcd: EtcdServer,
) -> None:
    ttl_s = Settings.model_fields["stream_owner_ttl_s"].default
    assert ttl_s == 10
    store = EtcdStore(etcd.url(f"default-{uuid.uuid4().hex[:8]}"))
    a, b = Node(store, "a", ttl_s), Node(store, "b", ttl_s)
    try:
        await a.ownership.start()
        await b.ownership.start()
        assert await a.ownership.acquire("s") is not None
        a.partition.cut = True  # dead right after its lease was granted
        cut_at = time.monotonic()
        await _acquire_within(b.ownership, "s", ttl_s + SLACK_S)
        assert time.monotonic() - cut_at >= ttl_s - 1.0
        assert [names for _, names in a.lost] == [["s"]]
    finally:
        await a.ownership.stop()
        await b.ownership.stop()
        await store.close()


async def test_a_malformed_owner_value_is_nobody_s_to_take(
    store: MetadataStore, nodes: Callable[..., Awaitable[Node]]
) -> None:
    """Not an owner's value (a bug, a hand-written key): refused as such, never taken over
    (it may be a newer format's owner)."""
    a = await nodes("a")
    for raw in [b"not json", b'{"v": 2, "node": "a", "url": "u", "sinceMs": 1}', b'{"v": 1}']:
        await store.commit({}, {owner_key("s"): raw})
        with pytest.raises(OwnerFormatError):
            await a.ownership.owner("s")
        assert await a.ownership.acquire("s") is None
    assert a.ownership.owned == {}
