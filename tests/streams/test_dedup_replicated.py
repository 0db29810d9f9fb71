"""Exactly-once appends of a replicated stream across owner failovers, on etcd and four node
processes: producers (X-Producer-Id, X-Sequence-Id) append through every node and retry
every append not acknowledged with the same payloads and ids, while the owner is SIGKILLed
(and later started again on its data) and the next owner is paused past its lease. Each new
owner rebuilds the producer table before it serves the stream (the snapshot in etcd and the
entries after it). Afterwards the stream checker finds each payload once, at the position
every acknowledgment of it named."""

from __future__ import annotations

import asyncio
import json
import signal

import pytest

from node.jepsen.streams import StreamWorkload, check_stream, read_back
from node.localcluster import LocalCluster
from tests.harness.cluster import MakeCluster
from tests.harness.streams import REPLICATED, etcd_get, owner, put_stream
from tests.streams.conftest import NODES, OWNER_TTL_S, STREAM_CLUSTER_ENV
from tests.streams.test_dedup_history import every_payload_acked

NAME = "orders"
POLICIES = {"deduplication": True, "maxEntriesPerLedger": 8, "minLedgerRolloverTimeMinutes": 0}
ACKED_PER_PHASE = 15  # appends acknowledged before a fault, during it, after it
PHASE_TIMEOUT_S = 90.0  # a lease's end and a takeover fit well within
TIMEOUT_S = 3.0  # a producer's wait for an answer; then it sends the append again
SLOW_FSYNC_S = 4.0  # a few WAL fsyncs of each node take longer than that


async def _new_owner(c: LocalCluster, old: str | None) -> str:
    """The stream's owner once it is another node than ``old``."""
    for _ in range(int(PHASE_TIMEOUT_S * 10)):
        now = await owner(c, NAME)
        if now is not None and now != old:
            return now
        await asyncio.sleep(0.1)
    raise AssertionError(f"no new owner of {NAME} after {old}")


@pytest.fixture
def dedup_cluster(make_cluster: MakeCluster) -> LocalCluster:
    """The streams' four nodes; a producer table snapshot every 5 entries; one slow fsync."""
    return make_cluster(
        nodes=NODES,
        env={
            **STREAM_CLUSTER_ENV,
            "NODE_STREAM_DEDUP_SNAPSHOT_INTERVAL_ENTRIES": "5",
            "NODE_FAULTS": json.dumps([f"journal.fsync=delay:{SLOW_FSYNC_S},after=20,times=1"]),
        },
    )


async def test_producers_retrying_through_owner_failovers_land_each_append_once(
    dedup_cluster: LocalCluster,
) -> None:
    c = dedup_cluster
    urls = [c.url(n) for n in c.node_ids]
    status, body = await put_stream(urls[0], NAME, {"replication": REPLICATED, **POLICIES})
    assert status == 201, body
    load = StreamWorkload(
        urls,
        NAME,
        writers=3,
        batch_max=3,
        seed=7,
        producers=True,
        timeout_s=TIMEOUT_S,
        cursor_readers=1,
        plain_readers=1,
    )
    async with load:
        load.start()
        await load.wait_acked(ACKED_PER_PHASE, PHASE_TIMEOUT_S)
        first = await owner(c, NAME)
        assert first is not None
        c.node(first).signal(signal.SIGKILL)  # requests in flight to it, or forwarded
        await asyncio.to_thread(c.kill, first)
        await load.wait_acked(load.acked + ACKED_PER_PHASE, PHASE_TIMEOUT_S)
        await asyncio.to_thread(c.start, first)
        second = await _new_owner(c, first)
        c.stop(second)  # paused past its lease: the stream moves on without it
        try:
            await asyncio.sleep(OWNER_TTL_S + 1)
            await load.wait_acked(load.acked + ACKED_PER_PHASE, PHASE_TIMEOUT_S)
        finally:
            c.cont(second)
        await load.wait_acked(load.acked + ACKED_PER_PHASE, PHASE_TIMEOUT_S)
        await load.stop()
    history = load.history()
    read = await read_back(urls[1], NAME)
    verdict = check_stream(history, read)
    assert verdict.ok, f"{load.outcomes}: {verdict}"
    assert not every_payload_acked(history), load.outcomes
    assert verdict.counts["read"] == len({d for op in history for d in op.digests()})
    assert load.outcomes.get("200", 0) >= 1, load.outcomes  # duplicates answered
    snapshot = await etcd_get(c, f"stream-dedup/{NAME}")
    assert snapshot is not None and set(snapshot["producers"]) == {"w0", "w1", "w2"}
