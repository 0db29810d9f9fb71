"""Exactly-once appends of a replicated stream across owner failovers, on etcd and four node
processes: producers (X-Producer-Id, X-Sequence-Id) append through every node and retry
every append not acknowledged with the same payloads and ids, while a node that forwards an
append to the owner is SIGKILLed with it in flight (the producer retries through another
node), the owner is SIGKILLed (and later started again on its data) and the next owner is
paused past its lease. Each new owner rebuilds the producer table before it serves the
stream (the snapshot in etcd and the entries after it). Afterwards the stream checker finds
each payload once, at the position every acknowledgment of it named, and the ledger checker
finds the same in the closed ledgers' replicas (behind each entry's producer header)."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from node.client.producer import StreamProducer
from node.jepsen.history import Op, merge
from node.jepsen.streams import StreamWorkload, check_stream, check_stream_ledgers, read_back
from node.localcluster import LocalCluster
from node.streams.model import Position
from tests.harness.cluster import MakeCluster
from tests.harness.metrics import parse_samples
from tests.harness.streams import (
    POLL_S,
    REPLICATED,
    call,
    etcd_get,
    owner,
    put_stream,
    stream_ledgers,
)
from tests.streams.conftest import NODES, OWNER_TTL_S, STREAM_CLUSTER_ENV
from tests.streams.test_dedup_history import unacked_payloads

NAME = "orders"
OFFLOAD_NOW = {"offloadThresholdInBytes": 0, "offloadDeletionLagInMillis": 0}
POLICIES = {"deduplication": True, "maxEntriesPerLedger": 8, "minLedgerRolloverTimeMinutes": 0}
ACKED_PER_PHASE = 15  # appends acknowledged before a fault, during it, after it
PHASE_TIMEOUT_S = 90.0  # a lease's end and a takeover fit well within
TIMEOUT_S = 3.0  # a producer's wait for an answer; then it sends the append again
SLOW_FSYNC_S = 4.0  # a few WAL fsyncs of each node take longer than that
BODY_BYTES = "storage_node_http_request_body_bytes_in_flight"  # held until answered
OCTET = "application/octet-stream"
FORWARDED_WAIT_S = 30.0  # the forwarded append's wait: it ends when its node is killed


async def _new_owner(c: LocalCluster, old: str | None) -> str:
    """The stream's owner once it is another node than ``old``."""
    for _ in range(int(PHASE_TIMEOUT_S * 10)):
        now = await owner(c, NAME)
        if now is not None and now != old:
            return now
        await asyncio.sleep(0.1)
    raise AssertionError(f"no new owner of {NAME} after {old}")


async def _body_bytes(url: str) -> float:
    """Request bodies the node at ``url`` holds: requests it has read and not answered."""
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as response:
        return parse_samples(await response.text())[(BODY_BYTES, ())]


async def _until(url: str, held: bool) -> None:
    for _ in range(int(PHASE_TIMEOUT_S / POLL_S)):
        if (await _body_bytes(url) > 0) == held:
            return
        await asyncio.sleep(POLL_S)
    raise AssertionError(f"{url} never {'held' if held else 'let go of'} a request body")


async def _kill_the_forwarder(c: LocalCluster, load: StreamWorkload) -> list[Op]:
    """A producer's append sent to a node that is not the owner, which forwards it to the
    owner (paused, so that the append stays in flight); that node is SIGKILLed while it
    holds the request, the owner goes on, and the producer sends the append again, same
    ids, through another node until it is acknowledged. Its operations (producer ``f0``)."""
    lead = await owner(c, NAME)
    assert lead is not None
    node_id = next(n for n in c.node_ids if n != lead)
    url = c.url(node_id)
    everyone = list(load.urls)
    load.urls[:] = [u for u in everyone if u != url]  # the node's own load drains first
    await _until(url, held=False)
    producer = StreamWorkload(
        [u for u in everyone if u != url], NAME, writers=1, prefix="f", producers=True,
        timeout_s=FORWARDED_WAIT_S,
    )  # fmt: skip
    async with producer:
        payloads, first = [b"forwarded-1"], 1_000
        c.stop(lead)
        try:
            sent = asyncio.create_task(producer.append(0, url=url, again=(payloads, first)))
            await _until(url, held=True)
            c.node(node_id).signal(signal.SIGKILL)
            await asyncio.to_thread(c.kill, node_id)
        finally:
            c.cont(lead)
        lost = await sent
        assert lost.type == "info", lost  # cut mid-request: the outcome is unknown
        producer.timeout_s = TIMEOUT_S
        op = lost
        while op.type != "ok":
            op = await producer.append(0, again=(payloads, first))
            assert not (op.error or "").startswith("4"), op
    await asyncio.to_thread(c.start, node_id)
    load.urls[:] = everyone
    return producer.history()


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
        forwarded = await _kill_the_forwarder(c, load)
        await load.wait_acked(load.acked + ACKED_PER_PHASE, PHASE_TIMEOUT_S)
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
    history = merge(load.history(), forwarded)
    read = await read_back(urls[1], NAME)
    verdict = check_stream(history, read)
    assert verdict.ok, f"{load.outcomes}: {verdict}"
    assert b"forwarded-1" in {payload for _, payload in read}
    # One level down: each closed ledger, read from its replicas, holds the payloads behind
    # their producer headers where the acknowledgments said, and nothing the cursor did not.
    closed = {info["id"] for info in await stream_ledgers(c, NAME) if info["closed"]}
    replicas = await check_stream_ledgers(history, read, c.metadata_url, closed)
    assert replicas.ok, str(replicas)
    assert len(closed) >= 3, closed  # across rollovers and failovers
    assert not unacked_payloads(history), (unacked_payloads(history), load.outcomes)
    assert verdict.counts["read"] == len({d for op in history for d in op.digests()})
    assert load.outcomes.get("200", 0) >= 1, load.outcomes  # duplicates answered
    snapshot = await etcd_get(c, f"stream-dedup/{NAME}")
    assert snapshot is not None and set(snapshot["producers"]) == {"w0", "w1", "w2", "f0"}


async def test_offloaded_ledgers_read_back_exactly_and_rebuild_the_table(
    make_cluster: MakeCluster, tmp_path: Path
) -> None:
    """A deduplicating stream's closed ledgers offloaded and their replicas deleted: reads
        through another node get exactly the bytes appended (the object store holds the entries
        as stored, header included); the owner stops, and the next one rebuilds the producer
        table from the offloaded ledgers: a retry of the first append is a duplicate still, answered
    with where it was stored. The
        producer's last sequence id is answered through a node that does not own the stream, and
        by the next owner."""
    env = {**STREAM_CLUSTER_ENV, "NODE_OFFLOAD_LOCAL_DIR": str(tmp_path / "objects")}
    c = await asyncio.to_thread(make_cluster, nodes=NODES, env=env)
    urls = [c.url(n) for n in c.node_ids]
    policies = {**POLICIES, "maxEntriesPerLedger": 3, **OFFLOAD_NOW, "replication": REPLICATED}
    status, body = await put_stream(urls[0], NAME, policies)
    assert status == 201, body
    async with StreamProducer(urls[0], NAME, "p") as producer:
        appended = [await producer.append(b"entry %d" % n) for n in range(8)]
    first_owner = await owner(c, NAME)
    assert first_owner is not None
    status, body = await call("POST", f"{c.url(first_owner)}/api/v1/offload/run", {})
    assert status == 200 and len(body["localDeleted"]) >= 2, body
    other = next(u for n, u in zip(c.node_ids, urls, strict=True) if n != first_owner)
    read = await read_back(other, NAME)
    assert read == [(a.position, b"entry %d" % n) for n, a in enumerate(appended)]
    last = {"producerId": "p", "lastSequenceId": 7, "position": appended[7].position}
    assert await call("GET", f"{other}/api/v1/streams/{NAME}/producers/p") == (200, last)
    await asyncio.to_thread(c.terminate, first_owner)
    async with StreamProducer(other, NAME, "p", resume=True) as producer:  # the next owner's
        assert producer.next_sequence == 8
    async with StreamProducer(other, NAME, "p") as producer:
        again = await producer.append(b"entry 0")
    # Its run (0..2, the first ledger's) is among the last ones p's entry keeps.
    assert (again.duplicate, again.position) == (True, appended[0].position)
    async with StreamProducer(other, NAME, "p", next_sequence=7) as producer:
        again = await producer.append(b"entry 7")
    assert (again.duplicate, again.position) == (True, appended[7].position)
    assert await owner(c, NAME) not in (None, first_owner)


async def _send(url: str, payload: bytes, sequence: int) -> tuple[int, Any, str | None]:
    """One append of producer ``p``: (status, JSON answer, X-Duplicate)."""
    headers = {"Content-Type": OCTET, "X-Producer-Id": "p", "X-Sequence-Id": str(sequence)}
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"{url}/api/v1/streams/{NAME}/entries",
            data=payload,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=PHASE_TIMEOUT_S),
        ) as response,
    ):
        return response.status, await response.json(), response.headers.get("X-Duplicate")


async def test_an_owner_that_loses_an_appends_outcome_settles_the_ledger_before_the_retry(
    make_cluster: MakeCluster,
) -> None:
    """Ensemble = write quorum = ack quorum = 3 on three nodes: with a replica SIGKILLed, the
    owner's add of a producer's append reaches the other two and its writer has no node to
    replace the dead one: the outcome is unknown (503 append_outcome_unknown). The owner
    marks the ledger closing and forgets its producer table; the retry (same ids) is not
    answered while the ledger's end cannot be settled (the replica is down), and once it
    can, the table is rebuilt from the entries up to that end: the retry is answered where
    the end put the append (200, a duplicate, when the ledger holds it; else 201 on the next
    ledger) and the stream holds it once."""
    c = await asyncio.to_thread(make_cluster, nodes=3, env=STREAM_CLUSTER_ENV)
    urls = [c.url(n) for n in c.node_ids]
    every_copy = {"ensemble": 3, "writeQuorum": 3, "ackQuorum": 3}
    status, body = await put_stream(urls[0], NAME, {"replication": every_copy, **POLICIES})
    assert status == 201, body
    async with StreamProducer(urls[0], NAME, "p") as producer:
        before = [await producer.append(b"entry %d" % n) for n in range(3)]
    lead = await owner(c, NAME)
    assert lead is not None
    replica = next(n for n in c.node_ids if n != lead)
    c.node(replica).signal(signal.SIGKILL)
    await asyncio.to_thread(c.kill, replica)
    status, body, _ = await _send(c.url(lead), b"entry 3", 3)
    assert (status, body["code"]) == (503, "append_outcome_unknown"), body
    status, body, _ = await _send(c.url(lead), b"entry 3", 3)  # its end cannot be settled
    assert (status, body["code"]) == (503, "recovery_failed"), body
    await asyncio.to_thread(c.start, replica)
    for _ in range(int(PHASE_TIMEOUT_S / POLL_S)):
        status, body, duplicate = await _send(c.url(lead), b"entry 3", 3)
        if status != 503:
            break
        await asyncio.sleep(POLL_S)
    assert status in (200, 201), body
    assert (status == 200) == (duplicate == "true")
    read = await read_back(urls[1], NAME)
    expected = [(a.position, b"entry %d" % n) for n, a in enumerate(before)]
    assert read == [*expected, (body["position"], b"entry 3")]
    ledgers = await stream_ledgers(c, NAME)
    first = Position.parse(str(before[0].position)).ledger_id
    assert [info["closed"] is not None for info in ledgers if info["id"] == first] == [True]
    status, body, duplicate = await _send(c.url(lead), b"entry 3", 3)
    assert (status, body["position"], duplicate) == (200, read[-1][0], "true")
