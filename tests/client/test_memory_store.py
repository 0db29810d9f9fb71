"""What the in-memory twin offers beyond the contract: leases on a clock the test drives."""

from __future__ import annotations

from node.client.metadata.memory import MemoryStore


async def test_leases_expire_on_the_clock_it_is_given() -> None:
    now = [100.0]
    store = MemoryStore(monotonic=lambda: now[0])
    lease = await store.grant_lease(10)
    await store.put("nodes/n1", b"up", lease=lease)
    now[0] += 9.9
    assert await store.keepalive(lease) is True  # renewed: ten more seconds from here
    now[0] += 9.9
    assert await store.get("nodes/n1") is not None
    now[0] += 0.1
    assert await store.get("nodes/n1") is None
    assert await store.keepalive(lease) is False
