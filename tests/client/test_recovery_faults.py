"""Recovery and close against real etcd and node processes when something is slow or changes
underneath: a paused replica does not hold a recovery (its re-adds
complete at Qa, the paused node's copies follow in the background); a re-replication swap made
in an older segment during a recovery survives its close; a client closed with adds in flight
settles every one of them as AddOutcomeUnknown."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from node.autorecovery import markers
from node.autorecovery.worker import DONE
from node.client import AddOutcomeUnknown, Client
from node.client.client import DEFAULT_RECOVERY_TIMEOUT_S
from node.client.errors import LedgerClosedElsewhere, LedgerClosedError, ReplicaError
from node.client.metrics import ADDS_UNKNOWN
from node.client.model import LedgerState, decode, encode, ledger_key
from node.localcluster import LocalCluster
from tests.client.realnodes import running_cluster
from tests.client.rereplication import mark_lost, rereplicate_at
from tests.harness.cluster import until

NODES = 4
# A shrunken recovery timeout, besides the default: the recovery must not scale with it.
SHORT_RECOVERY_TIMEOUT_S = 5.0
# How long the settled adds may take after the client's close (they were waiting forever).
SETTLE_BOUND_S = 5.0
POLL_S = 0.05
# An add timeout no test outlives: the paused replica's add stays out until the client closes.
ADD_NEVER_TIMES_OUT_S = 600.0


@pytest.fixture
async def four_nodes(tmp_path: Path) -> AsyncIterator[LocalCluster]:
    async with running_cluster(tmp_path / "cluster", NODES) as made:
        yield made


async def eventually(check: Callable[[], Awaitable[bool]], what: str, timeout_s: float) -> None:
    """Until the async ``check`` holds; fails naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        await asyncio.sleep(POLL_S)


async def holds(client: Client, node: str, ledger_id: int, entries: range) -> bool:
    """Whether ``node`` returns every one of ``entries`` (a plain read: nothing fenced)."""
    try:
        for entry_id in entries:
            await client.transport.read_entry(node, ledger_id, entry_id, fence=False)
    except ReplicaError:
        return False
    return True


async def read_all(client: Client, ledger_id: int) -> list[bytes]:
    reader = await client.open_ledger(ledger_id)
    return [p async for _, p in reader.read(0, reader.last_entry_id)]


@pytest.mark.parametrize(
    "recovery_timeout_s", [DEFAULT_RECOVERY_TIMEOUT_S, SHORT_RECOVERY_TIMEOUT_S], ids=str
)
async def test_a_paused_replica_does_not_hold_a_recovery(
    four_nodes: LocalCluster, recovery_timeout_s: float
) -> None:
    """3/3/2, entries 1-20 past the replicas' LAC (a batch carries the LAC before it), the
    writer gone, one replica SIGSTOPped: the recovery re-adds each entry at Qa and closes well
    within one recovery timeout, the paused node still named (no replacement needed); once it
    runs again its copies arrive from the re-adds still out."""
    payloads = [b"first", *(b"past-the-lac-%02d" % i for i in range(20))]
    async with Client(four_nodes.metadata_url) as writer:
        ledger = await writer.create_ledger(ensemble=3, write_quorum=3, ack_quorum=2)
        assert await ledger.add(payloads[0]) == 0
        assert await ledger.add_batch(payloads[1:]) == (1, 20)
    segments = ledger.metadata.segments
    paused = segments[-1].ensemble[0]
    await asyncio.to_thread(four_nodes.stop, paused)
    try:
        async with Client(
            four_nodes.metadata_url, recovery_timeout_s=recovery_timeout_s
        ) as recoverer:
            started = time.monotonic()
            closed = await recoverer.recover_ledger(ledger.id)
            elapsed = time.monotonic() - started
            assert elapsed < recovery_timeout_s / 3, f"recovery took {elapsed:.1f} s"
            assert (closed["state"], closed["lastEntryId"]) == ("CLOSED", 20)
            assert closed["length"] == sum(map(len, payloads))
            assert [s["ensemble"] for s in closed["segments"]] == [
                list(s.ensemble) for s in segments
            ]
            await asyncio.to_thread(four_nodes.cont, paused)
            await eventually(
                lambda: holds(recoverer, paused, ledger.id, range(1, 21)),
                f"{paused} holds the re-added entries",
                recovery_timeout_s,
            )
            assert await read_all(recoverer, ledger.id) == payloads
    finally:
        await asyncio.to_thread(four_nodes.cont, paused)


async def test_a_swap_in_an_older_segment_during_recovery_survives_its_close(
    four_nodes: LocalCluster,
) -> None:
    """A node lost mid-write: the writer's ensemble change leaves it named in segment 0. While
    the writer's ledger is recovered, the autorecovery worker copies segment 0's fragment of
    the lost node and swaps in the copy (at the recovery's "close" phase): the closed metadata
    keeps the swap, the marker is gone, every entry reads back."""
    payloads = [b"entry-%02d" % i for i in range(30)]
    async with Client(four_nodes.metadata_url) as writer:
        ledger = await writer.create_ledger(ensemble=3, write_quorum=3, ack_quorum=2)
        assert await ledger.add_batch(payloads[:10]) == (0, 9)
        lost = ledger.metadata.segments[0].ensemble[2]
        await asyncio.to_thread(four_nodes.kill, lost)
        assert await ledger.add_batch(payloads[10:20]) == (10, 19)
        # The two live copies may acknowledge the batch before the lost node's failure is
        # in (Qa = 2): the change then starts its segment after the batch, at 20.
        await until(lambda: len(ledger.metadata.segments) == 2, "the ensemble change")
        assert await ledger.add_batch(payloads[20:]) == (20, 29)
    split = ledger.metadata.segments[1].first_entry_id
    assert split in (10, 20), ledger.metadata.segments
    assert lost not in ledger.metadata.segments[1].ensemble
    async with Client(four_nodes.metadata_url) as recoverer:
        await mark_lost(recoverer, ledger.id, lost, int(time.time() * 1000))
        # The only node that can take the lost one's place was once seen unregistered (an
        # auditor's lost/ mark, kept until its next pass): registered now, it still may.
        (spare,) = set(four_nodes.node_ids) - set(ledger.metadata.segments[0].ensemble)
        await recoverer.store.create(markers.lost_key(spare), markers.encode_since(0))
        hook, swaps = rereplicate_at("close", recoverer, ledger.id)
        closed = await recoverer.recover_ledger(ledger.id, on_phase=hook)
        assert [(r.outcome, r.fragments) for r in swaps] == [(DONE, 1)]
        stored = await recoverer.ledger_metadata(ledger.id)
        for metadata in (closed, stored):
            assert (metadata["state"], metadata["lastEntryId"]) == ("CLOSED", 29)
            first = metadata["segments"][0]["ensemble"]
            assert lost not in first, metadata["segments"]
            assert first[:2] == list(ledger.metadata.segments[0].ensemble[:2])
            assert metadata["segments"][1] == {
                "firstEntryId": split,
                "ensemble": list(ledger.metadata.segments[1].ensemble),
            }
        assert await recoverer.store.get(markers.marker_key(ledger.id)) is None
        assert await read_all(recoverer, ledger.id) == payloads


def unknown_adds(reason: str) -> float:
    # The metric itself, not REGISTRY: its process collector reads /proc on the event loop.
    for family in ADDS_UNKNOWN.collect():
        for sample in family.samples:
            if sample.name.endswith("_total") and sample.labels == {"reason": reason}:
                return sample.value
    return 0.0


async def test_closing_the_client_settles_adds_in_flight(four_nodes: LocalCluster) -> None:
    """3/3/3 with one replica SIGSTOPped: adds go out and never reach Qa. The client's close
    settles every one of them with AddOutcomeUnknown (client_closed) and the handle's close
    waiting for them ends too (the ledger stays OPEN: a recovery decides)."""
    writer = Client(four_nodes.metadata_url, add_timeout_s=ADD_NEVER_TIMES_OUT_S)
    ledger = await writer.create_ledger(ensemble=3, write_quorum=3, ack_quorum=3)
    assert await ledger.add(b"acknowledged") == 0
    paused = ledger.metadata.last_segment.ensemble[1]
    live = [n for n in ledger.metadata.last_segment.ensemble if n != paused]
    await asyncio.to_thread(four_nodes.stop, paused)
    try:
        before = unknown_adds("client_closed")
        adds = [asyncio.ensure_future(ledger.add(b"in flight %d" % i)) for i in range(5)]
        adds.append(asyncio.ensure_future(ledger.add_batch([b"batch a", b"batch b"])))
        for node in live:  # the adds are out: the live replicas hold the last of them
            await eventually(
                lambda node=node: holds(writer, node, ledger.id, range(1, 8)),
                f"{node} holds the adds in flight",
                SETTLE_BOUND_S,
            )
        closing = asyncio.ensure_future(ledger.close())
        await asyncio.wait_for(writer.close(), SETTLE_BOUND_S)
        settled = await asyncio.wait_for(
            asyncio.gather(*adds, return_exceptions=True), SETTLE_BOUND_S
        )
        assert all(isinstance(o, AddOutcomeUnknown) for o in settled), settled
        assert [o.entry_id for o in settled if isinstance(o, AddOutcomeUnknown)] == [
            1,
            2,
            3,
            4,
            5,
            6,
        ]
        assert {o.reason for o in settled if isinstance(o, AddOutcomeUnknown)} == {"client_closed"}
        assert unknown_adds("client_closed") - before == 7
        with pytest.raises(LedgerClosedError):
            await asyncio.wait_for(closing, SETTLE_BOUND_S)
    finally:
        await writer.close()
        await asyncio.to_thread(four_nodes.cont, paused)
    async with Client(four_nodes.metadata_url) as reader:
        assert (await reader.ledger_metadata(ledger.id))["state"] == "OPEN"


async def test_close_refuses_a_ledger_closed_elsewhere_at_the_same_entry_and_another_length(
    four_nodes: LocalCluster,
) -> None:
    async with Client(four_nodes.metadata_url) as client:
        ledger = await client.create_ledger(ensemble=3, write_quorum=3, ack_quorum=2)
        assert await ledger.add_batch([b"a", b"bb"]) == (0, 1)
        # Someone closed it at the writer's lastEntryId with another length.
        key = ledger_key(ledger.id)
        current = await client.store.get(key)
        assert current is not None
        elsewhere = decode(current.value).evolve(
            state=LedgerState.CLOSED, last_entry_id=1, length=2
        )
        await client.store.cas(key, encode(elsewhere), current.revision)
        with pytest.raises(LedgerClosedElsewhere):
            await ledger.close()
