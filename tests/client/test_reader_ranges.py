"""The reader's range reads over in-memory nodes: one request per range to one replica
(sticky, failing over), each replica's stripe when E > Qw, and the entries a range did not
carry read alone from the other replicas, never taken as absent from one replica's silence."""

from __future__ import annotations

from node.client import Client, ReadFailed
from node.client.metadata.memory import MemoryStore
from tests.client.fakes import Network
from tests.client.test_writer import client, cluster

ENTRIES = 1000
RANGE = 100  # read_range_entries of these tests: ten ranges


def payload(entry_id: int) -> bytes:
    return b"entry-%05d" % entry_id


async def written(
    store: MemoryStore, net: Network, ensemble: int = 3, write_quorum: int = 3
) -> int:
    """A closed ledger of ENTRIES entries; its id."""
    async with client(store, net) as c:
        ledger = await c.create_ledger(ensemble=ensemble, write_quorum=write_quorum, ack_quorum=2)
        await ledger.add_batch([payload(i) for i in range(ENTRIES)])
        await ledger.close()
        return ledger.id


def reader(store: MemoryStore, net: Network, name: str = "r", **kwargs: object) -> Client:
    return client(store, net, name, read_range_entries=RANGE, **kwargs)


def reads_of(net: Network, name: str) -> list[tuple[str, dict[str, object]]]:
    return [(s.node, s.detail) for s in net.log if s.client == name and s.kind == "read"]


async def test_a_closed_ledger_reads_in_ranges_from_one_replica() -> None:
    store, net = await cluster(3)
    ledger_id = await written(store, net)
    async with reader(store, net) as r:
        handle = await r.open_ledger(ledger_id)
        found = [entry async for entry in handle.read(0, ENTRIES - 1)]
    assert found == [(i, payload(i)) for i in range(ENTRIES)]
    reads = reads_of(net, "r")
    assert len(reads) == ENTRIES // RANGE, reads
    assert len({node for node, _ in reads}) == 1, "the reader stays on one replica"


async def test_entries_a_replica_missed_come_from_the_others_one_by_one() -> None:
    """A replica short of a span (a slow replica the writer closed past at Qa): the range
    read returns what it holds, the span is read entry by entry from the other replicas."""
    store, net = await cluster(3)
    ledger_id = await written(store, net)
    missing = range(340, 400)
    for entry_id in missing:
        del net.nodes["n0"].ledgers[ledger_id].entries[entry_id]
    async with reader(store, net) as r:
        handle = await r.open_ledger(ledger_id)
        handle._sticky = "n0"  # the short replica answers the ranges
        found = [entry async for entry in handle.read(0, ENTRIES - 1)]
    assert found == [(i, payload(i)) for i in range(ENTRIES)]
    alone = {d["entry_id"] for _, d in reads_of(net, "r") if "last" not in d}
    assert alone == set(missing)


async def test_a_failing_replica_hands_its_ranges_to_the_next() -> None:
    store, net = await cluster(3)
    ledger_id = await written(store, net)
    net.nodes["n1"].down = True
    async with reader(store, net) as r:
        handle = await r.open_ledger(ledger_id)
        handle._sticky = "n1"
        found = [entry async for entry in handle.read(0, ENTRIES - 1)]
    assert found == [(i, payload(i)) for i in range(ENTRIES)]
    nodes = [node for node, _ in reads_of(net, "r")]  # a down node's requests are not logged
    assert len(nodes) == ENTRIES // RANGE and len(set(nodes)) == 1, nodes
    assert handle._sticky == nodes[0] != "n1"


async def test_a_read_error_cuts_the_range_and_that_entry_comes_from_another_replica() -> None:
    store, net = await cluster(3)
    ledger_id = await written(store, net)
    net.nodes["n2"].read_errors.add(555)
    async with reader(store, net) as r:
        handle = await r.open_ledger(ledger_id)
        handle._sticky = "n2"
        found = [entry async for entry in handle.read(0, ENTRIES - 1)]
    assert found == [(i, payload(i)) for i in range(ENTRIES)]


async def test_striped_ledgers_merge_each_replicas_stripe() -> None:
    store, net = await cluster(5)
    ledger_id = await written(store, net, ensemble=5, write_quorum=2)
    async with reader(store, net) as r:
        handle = await r.open_ledger(ledger_id)
        found = [entry async for entry in handle.read(0, ENTRIES - 1)]
    assert found == [(i, payload(i)) for i in range(ENTRIES)]
    reads = reads_of(net, "r")
    assert all("last" in d for _, d in reads), "no entry was read alone"
    assert len(reads) == 5 * ENTRIES // RANGE


async def test_an_entry_no_replica_returns_fails_the_read_rather_than_skipping() -> None:
    store, net = await cluster(3)
    ledger_id = await written(store, net)
    for node in net.nodes.values():
        node.ledgers[ledger_id].entries.pop(700)
    async with reader(store, net) as r:
        handle = await r.open_ledger(ledger_id)
        found = []
        try:
            async for entry in handle.read(0, ENTRIES - 1):
                found.append(entry)
        except ReadFailed as error:
            assert "entry 700" in str(error)
        else:
            raise AssertionError("a read skipped an entry no replica holds")
    assert found == [(i, payload(i)) for i in range(700)]
