"""The MetadataStore contract, against the real etcd and the in-memory twin alike (the
``store`` fixture runs each test on both)."""

from __future__ import annotations

import asyncio
import json

import pytest

from node.client.errors import CasConflict, NoSuchKey
from node.client.metadata.loop import update
from node.client.metadata.store import LEDGER_ID_BASE, MetadataStore

# etcd rounds a shorter TTL up to its minimum (1.5 election timeouts of its defaults)
LEASE_TTL_S = 2
LEASE_GONE_WITHIN_S = 10.0
POLL_S = 0.2


async def test_create_twice_is_refused(store: MetadataStore) -> None:
    first = await store.create("ledgers/1", b"one")
    with pytest.raises(CasConflict) as refused:
        await store.create("ledgers/1", b"two")
    assert refused.value.current == first
    assert await store.get("ledgers/1") == first


async def test_cas_needs_the_current_revision(store: MetadataStore) -> None:
    first = await store.create("k", b"v1")
    second = await store.cas("k", b"v2", first.revision)
    assert second.revision > first.revision
    with pytest.raises(CasConflict) as stale:
        await store.cas("k", b"v3", first.revision)
    assert stale.value.current == second
    assert await store.get("k", linearizable=False) == second
    with pytest.raises(NoSuchKey):
        await store.cas("absent", b"v", first.revision)


async def test_delete_needs_the_current_revision(store: MetadataStore) -> None:
    first = await store.create("k", b"v1")
    second = await store.cas("k", b"v2", first.revision)
    with pytest.raises(CasConflict):
        await store.delete("k", first.revision)
    await store.delete("k", second.revision)
    assert await store.get("k") is None
    with pytest.raises(NoSuchKey):
        await store.delete("k", second.revision)
    again = await store.create("k", b"v3")  # a deleted key may be created anew
    assert again.revision > second.revision


async def test_range_lists_a_prefix_in_key_order(store: MetadataStore) -> None:
    for key in ["ledgers/0000000002", "ledgers/0000000001", "ledgersx", "nodes/n1"]:
        await store.create(key, key.encode())
    listed = await store.range("ledgers/")
    assert [key for key, _ in listed] == ["ledgers/0000000001", "ledgers/0000000002"]
    assert [v.value for _, v in listed] == [b"ledgers/0000000001", b"ledgers/0000000002"]
    assert await store.range("streams/") == []


async def test_ids_are_unique_and_increasing_under_concurrency(store: MetadataStore) -> None:
    concurrent = await asyncio.gather(*(store.next_id() for _ in range(50)))
    assert len(set(concurrent)) == 50
    assert min(concurrent) > LEDGER_ID_BASE
    later = [await store.next_id() for _ in range(5)]
    assert later == sorted(later) and later[0] > max(concurrent)


async def test_the_cas_loop_converges_under_concurrent_updaters(store: MetadataStore) -> None:
    """20 updaters each add themselves to a JSON counter at once: every one gets in exactly
    once, whatever the interleaving of their conflicts."""
    await store.create("counter", json.dumps({"n": 0, "by": []}).encode())

    async def join(who: int) -> None:
        def needs(raw: bytes) -> bool:
            return who not in json.loads(raw)["by"]

        def add(raw: bytes) -> bytes:
            doc = json.loads(raw)
            return json.dumps({"n": doc["n"] + 1, "by": [*doc["by"], who]}).encode()

        done = await update(store, "counter", None, needs, add)
        assert not needs(done.value)

    await asyncio.gather(*(join(who) for who in range(20)))
    final = await store.get("counter")
    assert final is not None
    doc = json.loads(final.value)
    assert doc["n"] == 20 and sorted(doc["by"]) == list(range(20))


async def test_a_lease_not_kept_alive_expires_with_its_keys(store: MetadataStore) -> None:
    lease = await store.grant_lease(LEASE_TTL_S)
    await store.put("nodes/n1", b"up", lease=lease)
    await store.create("nodes/n2", b"up", lease=lease)
    await store.create("cookies/n1", b"stays")
    for _ in range(int(LEASE_GONE_WITHIN_S / POLL_S)):
        if not await store.range("nodes/"):
            break
        await asyncio.sleep(POLL_S)
    assert await store.range("nodes/") == []
    assert await store.get("cookies/n1") is not None
    assert await store.keepalive(lease) is False
    with pytest.raises(NoSuchKey):
        await store.put("nodes/n1", b"up", lease=lease)


async def test_keepalive_keeps_a_lease_and_revoke_ends_it(store: MetadataStore) -> None:
    lease = await store.grant_lease(LEASE_TTL_S)
    registered = await store.put("nodes/n1", b"up", lease=lease)
    for _ in range(int(3 * LEASE_TTL_S / 0.5)):  # three TTLs
        assert await store.keepalive(lease) is True
        await asyncio.sleep(0.5)
    assert await store.get("nodes/n1") == registered
    # a cas keeps the key under its lease
    changed = await store.cas("nodes/n1", b"readonly", registered.revision)
    await store.revoke(lease)
    assert await store.get("nodes/n1") is None
    assert changed.value == b"readonly"
    await store.revoke(lease)  # an ended lease is no error


async def test_a_watch_sees_every_change_under_its_prefix_in_order(store: MetadataStore) -> None:
    lease = await store.grant_lease(LEASE_TTL_S)
    first = await store.create("nodes/n1", b"writable")
    changes = store.watch("nodes/", first.revision)
    second = await store.cas("nodes/n1", b"readonly", first.revision)
    await store.create("cookies/n1", b"elsewhere")
    await store.delete("nodes/n1", second.revision)
    leased = await store.put("nodes/n2", b"up", lease=lease)
    seen = []
    async with asyncio.timeout(LEASE_GONE_WITHIN_S):
        async for change in changes:
            seen.append((change.key, change.value))
            if len(seen) == 5:
                break
    assert seen == [
        ("nodes/n1", first),
        ("nodes/n1", second),
        ("nodes/n1", None),
        ("nodes/n2", leased),
        ("nodes/n2", None),
    ]  # the lease ended unkept
    await changes.aclose()  # type: ignore[attr-defined]
