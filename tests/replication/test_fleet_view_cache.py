"""The fleet view reads every ledger in the store: a node reads it at most once per
``status_fleet_cache_s`` however many pages poll it (concurrent askers share one read), its
fleet poll notes a node gone (``lost/<id>``) without any page open, and its status summary
answers at once while the store does not (with the last view). A real etcd; the poller in
this process, or a node process."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from node.autorecovery import markers
from node.client.metadata.etcd import EtcdStore
from node.client.model import (
    LedgerMetadata,
    NodeInfo,
    NodeState,
    Segment,
    cookie_key,
    encode,
    ledger_key,
    node_key,
)
from node.metrics import FleetFigures
from node.replication.fleet import FleetPoller
from tests.harness.etcd import EtcdServer
from tests.harness.node import NodeProcess
from tests.replication._identity import fresh_prefix, replicated_node

TIMEOUT_S = 5.0
DELAY_S = 600.0
POLL_S = 3600.0  # the poller's loop is not started: each test calls poll() itself
# A summary while the store answers nothing: the view's wait (1 s) and the rest of the route,
# well under the metadata timeout (5 s, the default) that the view's read waits out.
SUMMARY_BOUND_S = 2.5
WAIT_S = 20.0


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


async def test_the_view_reads_each_state_from_the_store(etcd: EtcdServer) -> None:
    """Registered, read-only, decommissioning, unregistered within the delay, lost past it
    (the first sighting backdated, as an earlier poll or audit would have left it), and a
    node only a ledger names; with a delay of 0 a node gone is lost at once."""
    store = EtcdStore(etcd.url(fresh_prefix()))
    try:
        for node_id in ("a", "b", "c"):
            state = NodeState.READONLY if node_id == "b" else NodeState.WRITABLE
            info = NodeInfo(node_id, f"http://{node_id}", state=state)
            await store.create(node_key(node_id), info.encode())
        for node_id in ("a", "b", "c", "d", "e"):
            await store.create(cookie_key(node_id), b"{}")
        await store.create(markers.decommissioning_key("c"), markers.encode_since(1))
        now_ms = int(time.time() * 1000)
        await store.create(markers.lost_key("e"), markers.encode_since(now_ms - 601_000))
        meta = LedgerMetadata(7, 3, 3, 2, (Segment(0, ("a", "d", "x")),))
        await store.create(ledger_key(7), encode(meta))
        view = await (await _poller(store, cache_s=60)).view()
        assert view is not None
        states = {n.node_id: n.state for n in view.nodes}
        assert states == {
            "a": "registered",
            "b": "read_only",
            "c": "decommissioning",
            "d": "unregistered",
            "e": "lost",
            "x": "unregistered",
        }
        nodes = {n.node_id: n for n in view.nodes}
        assert nodes["d"].unregistered_since_ms is not None and nodes["x"].lost_at_ms is None
        assert [d.reachable for d in nodes["a"].open_ledgers] == [1]
        assert (view.at_risk_ledgers, view.at_risk_open_ledgers) == (1, 1)
        at_once = await FleetPoller(store, FleetFigures(), POLL_S, TIMEOUT_S, 0, 60).view()
        assert at_once is not None
        assert {n.node_id for n in at_once.nodes if n.state == "lost"} == {"d", "e"}
    finally:
        await store.close()


def _fleet(node: NodeProcess) -> dict[str, Any]:
    block = node.get_json("/api/v1/status/summary")["replication"]["fleet"]
    assert isinstance(block, dict)
    return block


def test_the_summary_answers_while_the_store_does_not(tmp_path: Path, own_etcd: EtcdServer) -> None:
    env = {"NODE_AUTORECOVERY_POLL_S": "0.2", "NODE_STATUS_FLEET_CACHE_S": "0.2"}
    node = replicated_node(tmp_path / "n1", own_etcd, fresh_prefix(), "n1", **env)
    node.start()
    deadline = time.monotonic() + WAIT_S
    while not _fleet(node)["nodes"]:
        assert time.monotonic() < deadline, "no fleet view read"
        time.sleep(0.1)
    own_etcd.pause()  # accepts connections, answers nothing: every read waits its timeout
    try:
        deadline = time.monotonic() + WAIT_S
        while True:
            asked = time.monotonic()
            block = _fleet(node)
            took = time.monotonic() - asked
            assert took < SUMMARY_BOUND_S, f"the summary took {took:.1f} s"
            if block["error"]:
                break
            assert time.monotonic() < deadline, "the view's read never failed"
            time.sleep(0.1)
        assert [n["id"] for n in block["nodes"]] == ["n1"]  # the last view, kept
    finally:
        own_etcd.resume()
    deadline = time.monotonic() + WAIT_S
    while _fleet(node)["error"]:
        assert time.monotonic() < deadline, "the view was not read again"
        time.sleep(0.1)
    node.terminate()
