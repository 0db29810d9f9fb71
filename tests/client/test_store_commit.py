"""MetadataStore.commit, the one-step guarded write of a stream's owner, against the real etcd
and the in-memory twin alike (the ``store`` fixture runs each test on both)."""

from __future__ import annotations

import asyncio

import pytest

from node.client.errors import CasConflict
from node.client.metadata.store import MetadataStore

# etcd rounds a shorter TTL up to its minimum
LEASE_TTL_S = 2
LEASE_GONE_WITHIN_S = 10.0
POLL_S = 0.2
RACERS = 20


async def test_a_failing_guard_writes_nothing(store: MetadataStore) -> None:
    a = await store.create("a", b"a1")
    b = await store.create("b", b"b1")
    moved = await store.cas("b", b"b2", b.revision)
    with pytest.raises(CasConflict) as refused:
        await store.commit(
            {"a": a.revision, "b": b.revision, "absent": 0},
            {"a": b"a2", "b": None, "c": b"c1"},
        )
    assert refused.value.key == "b" and refused.value.current == moved
    assert await store.get("a") == a
    assert await store.get("b") == moved
    assert await store.get("c") is None


async def test_the_conflict_names_the_first_guard_that_differs(store: MetadataStore) -> None:
    a = await store.create("a", b"a1")
    c = await store.create("c", b"c1")
    with pytest.raises(CasConflict) as refused:
        await store.commit({"a": a.revision, "c": 0, "gone": a.revision}, {"x": b"x"})
    assert refused.value.key == "c" and refused.value.current == c
    with pytest.raises(CasConflict) as absent:
        await store.commit({"a": a.revision, "gone": a.revision}, {"x": b"x"})
    # a key that is absent but was expected at a revision: a conflict with no current value
    assert absent.value.key == "gone" and absent.value.current is None
    assert await store.get("x") is None


async def test_a_zero_guard_needs_the_key_absent(store: MetadataStore) -> None:
    first = await store.commit({"k": 0}, {"k": b"v1"})
    with pytest.raises(CasConflict) as refused:
        await store.commit({"k": 0}, {"k": b"v2"})
    assert refused.value.current is not None
    assert refused.value.current.value == b"v1" and refused.value.current.revision == first
    # a key deleted is absent again
    await store.commit({"k": first}, {"k": None})
    again = await store.commit({"k": 0}, {"k": b"v3"})
    assert again > first


async def test_puts_and_deletes_land_at_the_revision_returned(store: MetadataStore) -> None:
    guard = await store.create("owner", b"me")
    doomed = await store.create("doomed", b"x")
    revision = await store.commit(
        {"owner": guard.revision}, {"record": b"r1", "cursor": b"c1", "doomed": None}
    )
    assert revision > doomed.revision
    record, cursor = await store.get("record"), await store.get("cursor")
    assert record is not None and cursor is not None
    assert record.revision == cursor.revision == revision
    assert await store.get("doomed") is None
    assert await store.get("owner") == guard  # a guard is read, not written
    # deleting what is absent changes nothing: the store's revision stays
    assert await store.commit({}, {"doomed": None}) == revision
    assert await store.commit({}, {}) == revision
    later = await store.commit({}, {"record": b"r2"})
    assert later == revision + 1


async def test_a_guard_on_a_key_whose_lease_ended_fails(store: MetadataStore) -> None:
    lease = await store.grant_lease(LEASE_TTL_S)
    owner = await store.create("owner", b"me", lease=lease)
    assert await store.commit({"owner": owner.revision}, {"record": b"r1"}) > owner.revision
    for _ in range(int(LEASE_GONE_WITHIN_S / POLL_S)):
        if await store.get("owner") is None:
            break
        await asyncio.sleep(POLL_S)
    with pytest.raises(CasConflict) as refused:
        await store.commit({"owner": owner.revision}, {"record": b"r2"})
    assert refused.value.key == "owner" and refused.value.current is None
    record = await store.get("record")
    assert record is not None and record.value == b"r1"


async def test_a_put_leaves_its_key_without_a_lease(store: MetadataStore) -> None:
    lease = await store.grant_lease(LEASE_TTL_S)
    leased = await store.create("k", b"leased", lease=lease)
    await store.commit({"k": leased.revision}, {"k": b"kept"})
    await store.revoke(lease)
    kept = await store.get("k")
    assert kept is not None and kept.value == b"kept"


async def test_racing_commits_on_one_guard_let_exactly_one_in(store: MetadataStore) -> None:
    """Every racer guards the owner key at the same revision and moves it: whatever the
    interleaving, one commit lands whole and every other writes nothing."""
    owner = await store.create("owner", b"0")
    results = await asyncio.gather(
        *(
            store.commit({"owner": owner.revision}, {"owner": str(i).encode(), f"by/{i}": b"x"})
            for i in range(RACERS)
        ),
        return_exceptions=True,
    )
    won = [i for i, result in enumerate(results) if isinstance(result, int)]
    assert len(won) == 1, results
    assert all(isinstance(r, CasConflict) for i, r in enumerate(results) if i != won[0])
    now = await store.get("owner")
    assert now is not None and now.value == str(won[0]).encode()
    assert now.revision == results[won[0]]
    assert [key for key, _ in await store.range("by/")] == [f"by/{won[0]}"]
    for result in results:
        if isinstance(result, CasConflict):
            assert result.key == "owner" and result.current == now
