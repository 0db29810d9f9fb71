"""The writer, reader and ledger lifecycle of the real client over in-memory nodes and the
in-memory store: striping, in-order acknowledgement, ensemble changes, fencing, close."""

from __future__ import annotations

import asyncio
import random

import pytest

from node.client import (
    AddFailed,
    AddOutcomeUnknown,
    Client,
    LedgerClosedElsewhere,
    LedgerFencedError,
    NoSuchLedger,
    NotEnoughNodes,
)
from node.client.metadata.memory import MemoryStore
from tests.client.fakes import FakeNode, FakeTransport, Network, register
from tests.harness.cluster import until

NODES = ["n0", "n1", "n2", "n3", "n4"]


async def cluster(count: int = 4, seed: int = 0, max_delay: int = 0) -> tuple[MemoryStore, Network]:
    store = MemoryStore()
    await register(store, NODES[:count])
    return store, Network([FakeNode(n) for n in NODES[:count]], seed=seed, max_delay=max_delay)


STARTED_ADDS = [False]  # whether the clients made by ``client`` start their adds


@pytest.fixture(autouse=True, params=[False, True], ids=["awaited adds", "started adds"])
def started_adds(request: pytest.FixtureRequest) -> None:
    """Every test runs with the writer awaiting each add in a task, and with the transport
    starting them (the writer then deals with the outcome by callbacks, as over HTTP)."""
    STARTED_ADDS[0] = request.param


def client(store: MemoryStore, net: Network, name: str = "w", **kwargs: object) -> Client:
    transport = FakeTransport(net, name, started_adds=STARTED_ADDS[0])
    return Client(store, transport=transport, rng=random.Random(1), **kwargs)  # type: ignore[arg-type]


async def test_lifecycle_stripes_and_reads_back() -> None:
    store, net = await cluster(4, max_delay=5)
    async with client(store, net) as c:
        ledger = await c.create_ledger(
            ensemble=3, write_quorum=2, ack_quorum=2, properties={"p": "v"}
        )
        assert await ledger.add(b"zero") == 0
        assert await ledger.add_batch([b"one", b"two", b"three"]) == (1, 3)
        ids = await asyncio.gather(*(ledger.add(b"x%d" % i) for i in range(10)))
        assert ids == list(range(4, 14))
        meta = ledger.metadata
        for entry_id in range(14):
            holders = {
                n
                for n, node in net.nodes.items()
                if entry_id in node.ledgers.get(ledger.id, _none()).entries
            }
            assert holders == set(meta.write_set(entry_id))
        closed = await ledger.close()
        assert closed.last_entry_id == 13 and closed.length == 4 + 3 + 3 + 5 + 20
        info = await c.ledger_metadata(ledger.id)
        assert (
            info["state"] == "CLOSED" and info["properties"] == {"p": "v"} and info["revision"] > 0
        )
        reader = await c.open_ledger(ledger.id)
        got = [(e, p) async for e, p in reader.read(0, reader.last_entry_id)]
        assert got[:4] == [(0, b"zero"), (1, b"one"), (2, b"two"), (3, b"three")]
        assert [e for e, _ in got] == list(range(14))
        with pytest.raises(AddFailed):
            await ledger.add(b"late")
        await c.delete_ledger(ledger.id)
        with pytest.raises(NoSuchLedger):
            await c.ledger_metadata(ledger.id)


def _none() -> object:
    class Empty:
        entries: dict[int, bytes] = {}

    return Empty()


async def test_batch_sends_one_request_per_node() -> None:
    store, net = await cluster(3)
    async with client(store, net) as c:
        ledger = await c.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2)
        await ledger.add_batch([b"%d" % i for i in range(30)])
        adds = [s for s in net.log if s.kind == "add"]
        assert len(adds) == 3
        assert sorted(len(s.detail["ids"]) for s in adds) == [20, 20, 20]  # type: ignore[arg-type]


async def test_single_adds_of_one_turn_share_a_request_per_node() -> None:
    """An idle writer's first add goes at once; the rest of the adds made in the same turn of
    the event loop go out together at its end (one request per node, also to the nodes the
    first went to), are acknowledged in order, and the next turn's adds carry the LAC the
    first ones made."""
    store, net = await cluster(3)
    async with client(store, net) as c:
        ledger = await c.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2)
        ensemble = ledger.metadata.last_segment.ensemble
        ids = await asyncio.gather(*(ledger.add(b"%d" % i) for i in range(30)))
        assert ids == list(range(30))
        requests = {
            node: [s.detail["ids"] for s in net.log if s.kind == "add" and s.node == node]
            for node in ensemble
        }
        first = ledger.metadata.write_set(0)
        for node, sent in requests.items():
            stripe = [i for i in range(30) if node in ledger.metadata.write_set(i)]
            assert sent == ([[0], stripe[1:]] if node in first else [stripe]), (node, sent)
        assert await ledger.add(b"next") == 30
        latest = [s for s in net.log if s.kind == "add"][5:]
        assert len(latest) == 2 and all(s.detail["lac"] == 29 for s in latest), latest


async def test_adds_made_while_a_request_to_a_node_is_out_go_together() -> None:
    """One add request per node out at a time (adds_in_flight_per_node): a slow node gets
    the adds made while it works in one request once it answers, and the fast nodes
    acknowledge them meanwhile."""
    store, net = await cluster(3)
    async with client(store, net) as c:
        ledger = await c.create_ledger(ensemble=3, write_quorum=3, ack_quorum=2)
        slow = ledger.metadata.last_segment.ensemble[2]
        gate = net.hold(lambda c, n, kind, d: n == slow and kind == "add" and d == "reply")
        for entry_id in range(6):
            assert await ledger.add(b"%d" % entry_id) == entry_id
        gate.release()
        stored = net.nodes[slow].ledgers[ledger.id].entries
        await until(lambda: len(stored) == 6, f"{slow} to store every entry")
        requests = {
            node: [s.detail["ids"] for s in net.log if s.kind == "add" and s.node == node]
            for node in ledger.metadata.last_segment.ensemble
        }
        assert requests.pop(slow) == [[0], [1, 2, 3, 4, 5]]
        assert all(ids == [[n] for n in range(6)] for ids in requests.values()), requests
        assert sorted(stored) == list(range(6))


async def test_open_reader_stops_at_lac_without_fencing() -> None:
    store, net = await cluster(3)
    async with client(store, net) as c:
        ledger = await c.create_ledger(ensemble=3, write_quorum=3, ack_quorum=2)
        await ledger.add_batch([b"a", b"b", b"c"])
        # The third copy of d is held: the replicas know LAC 2 (d's adds carried it), not 3.
        net.hold(lambda c, n, k, d: c == "w" and n == ledger.metadata.write_set(3)[2])
        await ledger.add(b"d")
        async with client(store, net, "r") as r:
            reader = await r.open_ledger(ledger.id)
            assert reader.last_entry_id == 2
            with pytest.raises(ValueError):
                [x async for x in reader.read(0, 3)]
            assert [e async for e, _ in reader.read(0, 3, past_lac=True)] == [0, 1, 2, 3]
        assert not any(x.fenced for n in net.nodes.values() for x in n.ledgers.values())
        assert await ledger.add(b"e") == 4


async def test_failed_node_changes_the_ensemble_and_resends() -> None:
    store, net = await cluster(4)
    async with client(store, net) as c:
        ledger = await c.create_ledger(ensemble=3, write_quorum=3, ack_quorum=3)
        await ledger.add_batch([b"a", b"b"])
        victim = ledger.metadata.segments[0].ensemble[1]
        net.nodes[victim].down = True
        assert await ledger.add(b"c") == 2
        meta = ledger.metadata
        assert len(meta.segments) == 2 and meta.segments[1].first_entry_id == 2
        assert victim not in meta.segments[1].ensemble
        spare = (set(NODES[:4]) - set(meta.segments[0].ensemble)).pop()
        assert 2 in net.nodes[spare].ledgers[ledger.id].entries
        closed = await ledger.close()
        assert closed.last_entry_id == 2 and len(closed.segments) == 2
        stored = await c.ledger_metadata(ledger.id)
        assert stored["segments"][1]["firstEntryId"] == 2


async def test_failure_after_the_ack_quorum_still_changes_the_ensemble() -> None:
    store, net = await cluster(4)
    async with client(store, net) as c:
        ledger = await c.create_ledger(ensemble=3, write_quorum=3, ack_quorum=2)
        victim = ledger.metadata.segments[0].ensemble[0]
        gate = net.hold(lambda c, n, kind, d: n == victim and d == "reply")
        assert await ledger.add(b"a") == 0  # two copies: acknowledged before the third answers
        assert len(ledger.metadata.segments) == 1
        net.nodes[victim].down = True  # its answer is lost: unknown, after the ack quorum
        gate.release()
        for _ in range(100):
            await asyncio.sleep(0)
        closed = await ledger.close()
        assert [s.first_entry_id for s in closed.segments] == [0, 1]
        assert victim not in closed.segments[1].ensemble


async def test_a_node_silent_past_the_add_timeout_is_replaced() -> None:
    """Its answer never comes (held): after ``add_timeout_s`` the copy counts as failed and
    the node is replaced, the add acknowledged by the replacement (Qa = Qw = 3)."""
    store, net = await cluster(4)
    async with client(store, net, add_timeout_s=0.2) as c:
        ledger = await c.create_ledger(ensemble=3, write_quorum=3, ack_quorum=3)
        silent = ledger.metadata.segments[0].ensemble[2]
        net.hold(lambda c, n, kind, d: n == silent and kind == "add")
        assert await asyncio.wait_for(ledger.add(b"a"), 5) == 0
        ensemble = ledger.metadata.last_segment.ensemble
        assert silent not in ensemble
        assert all(0 in net.nodes[n].ledgers[ledger.id].entries for n in ensemble)


async def test_no_replacement_makes_pending_adds_unknown() -> None:
    store, net = await cluster(3)
    async with client(store, net) as c:
        ledger = await c.create_ledger(ensemble=3, write_quorum=3, ack_quorum=3)
        net.nodes["n0"].down = True
        with pytest.raises(AddOutcomeUnknown) as caught:
            await ledger.add(b"a")
        assert caught.value.reason == "no_replacement"
        with pytest.raises(AddFailed):
            await ledger.add(b"b")


async def test_fenced_writer_gets_unknown_and_cannot_close() -> None:
    store, net = await cluster(3)
    async with client(store, net) as c:
        ledger = await c.create_ledger(ensemble=3, write_quorum=3, ack_quorum=2)
        await ledger.add(b"a")
        async with client(store, net, "r") as r:
            recovered = await r.recover_ledger(ledger.id)
        assert recovered["state"] == "CLOSED" and recovered["lastEntryId"] == 0
        with pytest.raises(AddOutcomeUnknown) as caught:
            await ledger.add(b"b")
        assert caught.value.reason == "fenced"
        with pytest.raises(LedgerFencedError):
            await ledger.close()


async def test_close_elsewhere_at_another_end() -> None:
    store, net = await cluster(3)
    async with client(store, net) as c:
        ledger = await c.create_ledger(ensemble=3, write_quorum=3, ack_quorum=2)
        await ledger.add(b"a")
        # Someone closed it at -1 (an operator's CAS straight into the store).
        from node.client.model import LedgerState, decode, encode, ledger_key

        key = ledger_key(ledger.id)
        current = await store.get(key)
        assert current is not None
        await store.cas(
            key, encode(decode(current.value).evolve(state=LedgerState.CLOSED)), current.revision
        )
        with pytest.raises(LedgerClosedElsewhere):
            await ledger.close()


async def test_not_enough_nodes() -> None:
    store, net = await cluster(2)
    async with client(store, net) as c:
        with pytest.raises(NotEnoughNodes):
            await c.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2)


async def test_a_busy_node_is_asked_again_not_replaced() -> None:
    store, net = await cluster(4)
    async with client(store, net) as c:
        ledger = await c.create_ledger(ensemble=3, write_quorum=3, ack_quorum=3)
        net.nodes[ledger.metadata.last_segment.ensemble[0]].busy = 3
        assert await ledger.add(b"a") == 0
        assert len(ledger.metadata.segments) == 1


async def test_a_busy_nodes_retry_carries_the_lac_its_request_was_made_with() -> None:
    """Qa=2 of 3: while one node pushes back on entry 0, the two others acknowledge entries
    0 and 1. The retry must not claim LAC 1 for a request of entry 0 (a node refuses that
    with invalid_lac, and the writer would replace a node that only was busy)."""
    store, net = await cluster(4)
    async with client(store, net) as c:
        ledger = await c.create_ledger(ensemble=3, write_quorum=3, ack_quorum=2)
        busy = ledger.metadata.last_segment.ensemble[2]
        net.nodes[busy].busy = 1
        assert await ledger.add(b"a") == 0
        assert await ledger.add(b"b") == 1
        await asyncio.sleep(0.2)  # past the busy node's pause: its retry of entry 0 went
        await ledger.close()
        assert len(ledger.metadata.segments) == 1, ledger.metadata.segments
        assert set(net.nodes[busy].ledgers[ledger.id].entries) == {0, 1}


async def test_metrics_count_changes_unknown_adds_and_recoveries() -> None:
    from prometheus_client.metrics import MetricWrapperBase

    from node.client import metrics

    def value(metric: MetricWrapperBase, name: str, **labels: str) -> float:
        for family in metric.collect():  # not REGISTRY: its process collector reads /proc
            for sample in family.samples:
                if sample.name == name and sample.labels == labels:
                    return sample.value
        return 0.0

    changes_total = "storage_client_ensemble_changes_total"
    changes = value(metrics.ENSEMBLE_CHANGES, changes_total)
    unknown = "storage_client_adds_unknown_total"
    fenced = value(metrics.ADDS_UNKNOWN, unknown, reason="fenced")
    recoveries = "storage_client_recoveries_total"
    recovered = value(metrics.RECOVERIES, recoveries, outcome="closed")
    store, net = await cluster(4)
    async with client(store, net) as c:
        ledger = await c.create_ledger(ensemble=3, write_quorum=3, ack_quorum=3)
        net.nodes[ledger.metadata.last_segment.ensemble[0]].down = True
        await ledger.add(b"a")
        assert value(metrics.ENSEMBLE_CHANGES, changes_total) == changes + 1
        await c.recover_ledger(ledger.id)
        assert value(metrics.RECOVERIES, recoveries, outcome="closed") == recovered + 1
        with pytest.raises(AddOutcomeUnknown):
            await ledger.add(b"b")
        assert value(metrics.ADDS_UNKNOWN, unknown, reason="fenced") == fenced + 1
        node = ledger.metadata.last_segment.ensemble[1]
        count = "storage_client_replica_add_seconds_count"
        assert value(metrics.REPLICA_ADD_SECONDS, count, node=node) >= 1


def test_sync_client_over_in_memory_nodes() -> None:
    from node.client.sync import SyncClient

    store = MemoryStore()
    net = Network([FakeNode(n) for n in NODES[:3]])
    with SyncClient(store, transport=FakeTransport(net, "s")) as c:
        c._loop.run(register(store, NODES[:3]))
        ledger = c.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2)
        assert ledger.add(b"a") == 0
        assert ledger.add_batch([b"b", b"c"]) == (1, 2)
        assert ledger.close().last_entry_id == 2
        reader = c.open_ledger(ledger.id)
        assert list(reader.read(0, reader.last_entry_id)) == [(0, b"a"), (1, b"b"), (2, b"c")]
        assert c.ledger_metadata(ledger.id)["length"] == 3
        assert c.ledgers() == [ledger.id]
        c.delete_ledger(ledger.id)
        assert c.ledgers() == []


async def test_too_large_entries_are_not_sent_and_big_batches_are_split() -> None:
    store, net = await cluster(3)
    async with client(store, net, max_entry_size=100, max_request_bytes=250) as c:
        ledger = await c.create_ledger(ensemble=3, write_quorum=3, ack_quorum=2)
        with pytest.raises(AddFailed):
            await ledger.add(b"x" * 101)
        assert await ledger.add_batch([b"y" * 100] * 5) == (0, 4)  # no id taken by the refusal
        sizes = sorted(len(s.detail["ids"]) for s in net.log if s.kind == "add")  # type: ignore[arg-type]
        assert sizes == [1, 1, 1, 2, 2, 2, 2, 2, 2]
    store, net = await cluster(3)
    async with client(store, net, max_request_entries=3) as c:
        ledger = await c.create_ledger(ensemble=3, write_quorum=3, ack_quorum=2)
        assert await ledger.add_batch([b"z"] * 7) == (0, 6)
        sizes = sorted(len(s.detail["ids"]) for s in net.log if s.kind == "add")  # type: ignore[arg-type]
        assert sizes == [1, 1, 1, 3, 3, 3, 3, 3, 3]


async def test_a_read_asks_the_next_replica_when_one_is_slow_or_fails() -> None:
    store, net = await cluster(3)
    async with client(store, net) as c:
        ledger = await c.create_ledger(ensemble=3, write_quorum=3, ack_quorum=2)
        await ledger.add_batch([b"a", b"b"])
        await ledger.close()
    # Two replicas pause on reads: the third answers within the speculative delays.
    paused = net.hold(lambda c, n, k, d: k == "read" and n in ("n0", "n1"))
    async with client(store, net, "r", speculative_read_s=0.01, read_timeout_s=30) as r:
        reader = await r.open_ledger(ledger.id)
        started = asyncio.get_running_loop().time()
        assert [p async for _, p in reader.read(0, 1)] == [b"a", b"b"]
        assert asyncio.get_running_loop().time() - started < 5
        paused.release()
    net.nodes["n2"].read_errors.add(0)  # io_error on one replica: another one answers
    async with client(store, net, "r2") as r:
        reader = await r.open_ledger(ledger.id)
        assert [p async for _, p in reader.read(0, 0)] == [b"a"]
