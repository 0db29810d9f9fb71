"""The fleet view reads every ledger in the store: a node reads it at most once per
``status_fleet_cache_s`` however many pages poll it (concurrent askers share one read), and
its fleet poll notes a node gone (``lost/<id>``) without any page open. A real etcd; the
poller in this process."""

from __future__ import annotations

import asyncio

from node.autorecovery import markers
from node.client.metadata.etcd import EtcdStore
from node.client.model import NodeInfo, cookie_key, node_key
from node.metrics import FleetFigures
from node.replication.fleet import FleetPoller
from tests.harness.etcd import EtcdServer
from tests.replication._identity import fresh_prefix

TIMEOUT_S = 5.0
DELAY_S = 600.0
POLL_S = 3600.0  # the poller's loop is not started: each test calls poll() itself


async def _poller(store: EtcdStore, cache_s: float) -> FleetPoller:
    return FleetPoller(store, FleetFigures(), POLL_S, TIMEOUT_S, DELAY_S, cache_s)


async def test_the_view_is_read_once_per_cache_period(etcd: EtcdServer) -> None:
    store = EtcdStore(etcd.url(fresh_prefix()))
    try:
        await store.create(node_key("a"), NodeInfo("a", "http://a").encode())
        poller = await _poller(store, cache_s=60)
        first, *others = await asyncio.gather(*(poller.view() for _ in range(5)))
        assert first is not None and all(view is first for view in others)
        await store.create(node_key("b"), NodeInfo("b", "http://b").encode())
        again = await poller.view()
        assert again is first and [n.node_id for n in again.nodes] == ["a"]

        # Past its period (or ten times the read's time, if longer) the view is read again.
        fresh = await _poller(store, cache_s=0.05)
        before = after = await fresh.view()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + TIMEOUT_S
        while after is before:
            assert loop.time() < deadline, "the view was never read again"
            await asyncio.sleep(0.05)
            after = await fresh.view()
        assert after is not None and [n.node_id for n in after.nodes] == ["a", "b"]
    finally:
        await store.close()


async def test_the_fleet_poll_notes_a_node_gone_and_forgets_it_once_back(
    etcd: EtcdServer,
) -> None:
    store = EtcdStore(etcd.url(fresh_prefix()))
    try:
        await store.create(cookie_key("a"), b"{}")
        poller = await _poller(store, cache_s=60)
        assert await poller.poll()
        mark = await store.get(markers.lost_key("a"))
        assert mark is not None
        since = markers.decode_since(mark.value)
        # Noted once: a later poll keeps the first sighting's time.
        assert await poller.poll()
        kept = await store.get(markers.lost_key("a"))
        assert kept is not None and markers.decode_since(kept.value) == since
        await store.create(node_key("a"), NodeInfo("a", "http://a").encode())
        assert await poller.poll()
        assert await store.get(markers.lost_key("a")) is None
    finally:
        await store.close()
