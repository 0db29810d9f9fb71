"""Readers and the past-end probe against real etcd and node processes: a reader's operations
while a writer writes are all in the history and judged clean, and the checker's probe past a
closed ledger's end reaches the replicas themselves (the client refuses those ids before any
request)."""

from __future__ import annotations

import asyncio
import random

from node.client import Client
from node.jepsen.checker import PAST_END_PROBES, check, check_cluster, observe
from node.jepsen.history import History, digest, merge
from node.jepsen.workload import Reader, Writer
from node.localcluster import LocalCluster

ADDS = 40  # by the writer while the reader reads
SHAPE = (3, 3, 2)


async def test_a_reader_during_the_writes_is_in_the_history_and_judged(
    cluster: LocalCluster,
) -> None:
    writes, reads = History("w0"), History("rd0")
    stop = asyncio.Event()
    async with (
        Client(cluster.metadata_url, rng=random.Random(1)) as client,
        Client(cluster.metadata_url, rng=random.Random(2)) as reader_client,
    ):
        writer = await Writer.create(client, writes, random.Random(1), *SHAPE)
        reader = Reader(reader_client, reads, random.Random(2), [writer.ledger.id])
        reading = asyncio.create_task(reader.run(stop))
        for _ in range(ADDS):
            assert await writer.add() >= 0
        assert await writer.close() == ADDS - 1
        stop.set()
        await reading
    assert reader.whole == {writer.ledger.id}, "the closed ledger was read whole at the end"
    functions = {(op.f, op.type) for op in reads.ops}
    assert {("read_lac", "ok"), ("read", "ok")} <= functions, functions
    verdict = await check_cluster(merge(writes.ops, reads.ops), cluster.metadata_url)
    assert verdict.ok, verdict
    assert verdict.counts["reads"] == verdict.counts["reads_ok"] > 0
    assert verdict.counts["read_entries"] >= ADDS


async def test_the_past_end_probe_reaches_the_replicas(cluster: LocalCluster) -> None:
    """A closed ledger's replicas are given entries past its end behind the client's back: an
    unknown add's bytes (a leftover the recovery did not find) and bytes nobody wrote. The
    probe finds both on each replica; the checker counts the first and names the second."""
    history = History("w0")
    async with Client(cluster.metadata_url) as client:
        writer = await Writer.create(client, history, random.Random(3), *SHAPE)
        for _ in range(3):
            assert await writer.add() >= 0
        last = await writer.close()
        leftover, ghost = writer.payload(), b"ghost"
        history.log("invoke", "add", writer.ledger.id, None, digest(leftover))
        history.log("info", "add", writer.ledger.id, None, digest(leftover))
        nodes = list(writer.ledger.metadata.last_segment.ensemble)
        for node in nodes:
            await client.transport.add(
                node,
                writer.ledger.id,
                [(last + 1, leftover), (last + 2, ghost)],
                lac=last,
                lac_length=0,
                replication=SHAPE,
            )
        seen = await observe(client, "r0", writer.ledger.id)
    assert PAST_END_PROBES >= 2
    assert sorted(seen.past_end) == sorted(
        [(last + 1, node, digest(leftover)) for node in nodes]
        + [(last + 2, node, digest(ghost)) for node in nodes]
    )
    verdict = check(history.ops, {writer.ledger.id: [seen]})
    assert verdict.kinds() == {"phantom"}
    assert {v.entry for v in verdict.violations} == {last + 2}
    assert verdict.counts["leftovers"] == len(nodes)
