"""The client against a real etcd and real node processes on loopback (node/localcluster.py):
create, add, add_batch, close, open, read, recover, delete; a reader of an OPEN ledger that
fences nothing; a node SIGKILLed mid-write (the writer changes the ensemble and goes on, every
acknowledged entry reads back byte for byte); a recovery from another client while the writer
is alive (its next add is AddOutcomeUnknown, nothing it had acknowledged is lost)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from node.client import AddOutcomeUnknown, Client, LedgerFencedError, NoSuchLedger
from node.localcluster import LocalCluster
from tests.client.realnodes import running_cluster
from tests.harness.cluster import cluster_env

NODES = 4


@pytest.fixture
async def four_nodes(tmp_path: Path) -> AsyncIterator[LocalCluster]:
    async with running_cluster(tmp_path / "cluster", NODES) as made:
        yield made


@pytest.fixture
async def client(four_nodes: LocalCluster) -> AsyncIterator[Client]:
    async with Client(four_nodes.metadata_url) as made:
        yield made


async def read_all(c: Client, ledger_id: int, *, recover: bool = False) -> list[bytes]:
    reader = await c.open_ledger(ledger_id, recover=recover)
    return [p async for _, p in reader.read(0, reader.last_entry_id)]


async def test_ledger_lifecycle_on_real_nodes(client: Client, four_nodes: LocalCluster) -> None:
    ledger = await client.create_ledger(
        ensemble=3, write_quorum=3, ack_quorum=2, properties={"purpose": "test"}
    )
    assert await ledger.add(b"payload") == 0
    assert await ledger.add_batch([b"a", b"b"]) == (1, 2)
    await ledger.close()
    metadata = await client.ledger_metadata(ledger.id)
    assert metadata["state"] == "CLOSED"
    assert (metadata["lastEntryId"], metadata["length"]) == (2, 9)
    assert metadata["properties"] == {"purpose": "test"}
    assert len(set(metadata["segments"][0]["ensemble"])) == 3
    assert await read_all(client, ledger.id) == [b"payload", b"a", b"b"]
    # Striped: E=4, Qw=2: each node holds half the entries, one request per node per batch.
    striped = await client.create_ledger(ensemble=4, write_quorum=2, ack_quorum=2)
    payloads = [b"entry %d " % i * (i % 7 + 1) for i in range(200)]
    assert await striped.add_batch(payloads[:100]) == (0, 99)
    for payload in payloads[100:150]:
        await striped.add(payload)
    assert await asyncio.gather(*(striped.add(p) for p in payloads[150:])) == list(range(150, 200))
    await striped.close()
    assert await read_all(client, striped.id) == payloads
    # A second client reads the same bytes.
    async with Client(four_nodes.metadata_url) as other:
        assert await read_all(other, striped.id) == payloads
        await other.delete_ledger(striped.id)
    with pytest.raises(NoSuchLedger):
        await client.ledger_metadata(striped.id)
    await client.delete_ledger(ledger.id)
    assert await client.ledgers() == []


async def test_reader_of_an_open_ledger_stops_at_the_lac_and_fences_nothing(
    client: Client, four_nodes: LocalCluster
) -> None:
    ledger = await client.create_ledger(ensemble=3, write_quorum=3, ack_quorum=2)
    await ledger.add_batch([b"0", b"1", b"2"])
    await ledger.add(b"3")  # carries LAC 2
    async with Client(four_nodes.metadata_url) as other:
        reader = await other.open_ledger(ledger.id)
        # 2 even when the third replica's add of entry 3 waited behind its batch and went out
        # after the other two had acknowledged it: a piggybacked LAC stays below its add.
        assert reader.last_entry_id == 2
        assert [p async for _, p in reader.read(0, 2)] == [b"0", b"1", b"2"]
    assert await ledger.add(b"4") == 4  # not fenced
    await ledger.close()


async def test_recovery_by_another_client_fences_the_writer(
    client: Client, four_nodes: LocalCluster
) -> None:
    ledger = await client.create_ledger(ensemble=3, write_quorum=3, ack_quorum=2)
    acknowledged = [b"entry-%d" % i for i in range(20)]
    await ledger.add_batch(acknowledged[:10])
    for payload in acknowledged[10:]:
        await ledger.add(payload)
    async with Client(four_nodes.metadata_url) as recoverer:
        assert await read_all(recoverer, ledger.id, recover=True) == acknowledged
        metadata = await recoverer.ledger_metadata(ledger.id)
    assert (metadata["state"], metadata["lastEntryId"]) == ("CLOSED", 19)
    assert metadata["length"] == sum(map(len, acknowledged))
    with pytest.raises(AddOutcomeUnknown):
        await ledger.add(b"after the fence")
    with pytest.raises(LedgerFencedError):
        await ledger.close()
    assert await read_all(client, ledger.id) == acknowledged


async def test_a_node_killed_mid_write_is_replaced(
    client: Client, four_nodes: LocalCluster
) -> None:
    ledger = await client.create_ledger(ensemble=3, write_quorum=3, ack_quorum=3)
    payloads = [b"x%d" % i * 100 for i in range(60)]
    assert await ledger.add_batch(payloads[:20]) == (0, 19)
    victim = ledger.metadata.last_segment.ensemble[1]
    await asyncio.to_thread(four_nodes.kill, victim)
    for payload in payloads[20:40]:
        await ledger.add(payload)
    assert await ledger.add_batch(payloads[40:]) == (40, 59)
    closed = await ledger.close()
    assert len(closed.segments) == 2 and victim not in closed.segments[1].ensemble
    assert closed.segments[1].first_entry_id == 20
    async with Client(four_nodes.metadata_url) as reader:
        assert await read_all(reader, ledger.id) == payloads


async def test_recovery_after_the_writer_is_gone_keeps_what_it_acknowledged(
    four_nodes: LocalCluster,
) -> None:
    writer = Client(four_nodes.metadata_url)
    ledger = await writer.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2)
    payloads = [b"w%d" % i for i in range(30)]
    for payload in payloads:
        await ledger.add(payload)
    await writer.close()  # gone without closing the ledger: the replicas' LAC lags by one
    async with Client(four_nodes.metadata_url) as recoverer:
        assert await read_all(recoverer, ledger.id, recover=True) == payloads
        second = await recoverer.recover_ledger(ledger.id)  # idempotent
    assert second["lastEntryId"] == 29


async def test_a_batch_larger_than_a_node_takes_in_one_request(client: Client) -> None:
    ledger = await client.create_ledger(ensemble=3, write_quorum=3, ack_quorum=2)
    payloads = [b"%08d" % i for i in range(12_345)]  # past the node's max_entries_per_batch
    assert await ledger.add_batch(payloads) == (0, 12_344)
    closed = await ledger.close()
    assert (closed.last_entry_id, closed.length) == (12_344, 8 * 12_345)
    reader = await client.open_ledger(ledger.id)
    tail = [(e, p) async for e, p in reader.read(9_990, 10_010)]
    assert tail == [(e, payloads[e]) for e in range(9_990, 10_011)]


async def test_nodes_with_an_admin_token_take_replica_adds_only_with_it(tmp_path: Path) -> None:
    """With NODE_ADMIN_TOKEN set, every write needs it, replica adds and fences included: a
    client given the token writes, recovers and reads; one without it gets a clear refusal
    (the outcome unknown, never a silent loss) and cannot fence the ledger."""
    env = {**cluster_env(), "NODE_ADMIN_TOKEN": "replication-secret"}
    made = await asyncio.to_thread(LocalCluster, tmp_path, nodes=3, env=env)
    try:
        async with Client(made.metadata_url, token="replication-secret") as client:
            ledger = await client.create_ledger(ensemble=3, write_quorum=3, ack_quorum=2)
            assert await ledger.add_batch([b"a", b"b"]) == (0, 1)
            async with Client(made.metadata_url) as stranger:
                refused = await stranger.create_ledger(ensemble=3, write_quorum=3, ack_quorum=2)
                with pytest.raises(AddOutcomeUnknown) as unknown:
                    await refused.add(b"never")
                assert unknown.value.reason == "unauthorized"
                assert await stranger.ledgers() == sorted([ledger.id, refused.id])
            assert await ledger.add(b"c") == 2  # the refusals fenced nothing
            recovered = await client.recover_ledger(ledger.id)
            assert (recovered["state"], recovered["lastEntryId"]) == ("CLOSED", 2)
            assert await read_all(client, ledger.id) == [b"a", b"b", b"c"]
    finally:
        await asyncio.to_thread(made.close)
