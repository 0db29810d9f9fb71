"""Seeded fault rounds on one replicated stream each, on etcd and four node processes: writers
append through every node (small ledgers: rollovers all the time) while a fault drawn from
the seed hits the owner or another node (SIGKILL then a restart on the same data, SIGSTOP
then SIGCONT, SIGKILL and back at once); once healed the writers go on, then a cursor
through a node drawn from the seed reads the stream back, and both checkers run: the
stream's (node/jepsen/streams.py) and the replicated ledgers' on every closed ledger. Cursor
and plain readers read all along; their reads are in the history and judged too."""

from __future__ import annotations

import asyncio
import random
import signal
from collections.abc import Awaitable, Callable

import pytest

from node.jepsen.streams import StreamWorkload, check_stream, check_stream_ledgers, read_back
from node.localcluster import LocalCluster
from tests.harness.streams import REPLICATED, owner, put_stream, stream_ledgers, stream_record

SEEDS = (0, 1, 2, 4)  # kill another node, kill the owner, pause it, kill it and back
POLICIES = {"maxEntriesPerLedger": 6, "minLedgerRolloverTimeMinutes": 0}
ACKED_PER_PHASE = 15  # operations acknowledged before the fault, during it, after the healing
READERS = 2  # cursor readers, and as many plain readers, beside the writers
PHASE_TIMEOUT_S = 90.0  # a lease's end and a takeover fit well within
FAULT_HOLD_S = (0.5, 4.0)  # a pause or a downtime lasts this long, drawn from the seed

Step = Callable[[], Awaitable[None]]


def fault(c: LocalCluster, rng: random.Random, stream_owner: str) -> tuple[str, Step, Step]:
    """(its name, apply, heal), drawn from ``rng``: against the owner, or another node."""
    target = stream_owner if rng.random() < 0.7 else rng.choice(c.node_ids)
    kind = rng.choice(["kill", "pause", "bounce"])

    async def kill() -> None:
        c.node(target).signal(signal.SIGKILL)
        await asyncio.to_thread(c.kill, target)

    async def start() -> None:
        await asyncio.to_thread(c.start, target)

    async def pause() -> None:
        c.stop(target)

    async def resume() -> None:
        c.cont(target)

    async def bounce() -> None:
        await kill()
        await start()

    async def nothing() -> None:
        pass

    steps = {"kill": (kill, start), "pause": (pause, resume), "bounce": (bounce, nothing)}
    apply, heal = steps[kind]
    return f"{kind} {target}", apply, heal


@pytest.mark.parametrize("seed", SEEDS)
async def test_a_seeded_fault_loses_no_acknowledged_append(
    stream_cluster: LocalCluster, seed: int
) -> None:
    c = stream_cluster
    rng = random.Random(seed)
    name = f"faults{seed}"
    urls = [c.url(n) for n in c.node_ids]
    status, body = await put_stream(rng.choice(urls), name, {"replication": REPLICATED, **POLICIES})
    assert status == 201, body
    assert (await stream_record(c, name))["replication"] == REPLICATED
    load = StreamWorkload(
        urls,
        name,
        writers=3,
        batch_max=3,
        seed=seed,
        cursor_readers=READERS,
        plain_readers=READERS,
    )
    async with load:
        load.start()
        await load.wait_acked(ACKED_PER_PHASE, PHASE_TIMEOUT_S)
        first_owner = await owner(c, name)
        assert first_owner is not None
        what, apply, heal = fault(c, rng, first_owner)
        await apply()
        try:
            await asyncio.sleep(rng.uniform(*FAULT_HOLD_S))
            await load.wait_acked(load.acked + ACKED_PER_PHASE, PHASE_TIMEOUT_S)
        finally:
            await heal()
        await load.wait_acked(load.acked + ACKED_PER_PHASE, PHASE_TIMEOUT_S)
        await load.stop()
    history = load.history()
    reader = rng.choice(urls)
    read = await read_back(reader, name)
    verdict = check_stream(history, read)
    assert verdict.ok, f"seed {seed} ({what}, read via {reader}): {verdict}"
    assert verdict.counts["read_entries"] > 0, verdict.counts
    ledgers = await stream_ledgers(c, name)
    closed = {info["id"] for info in ledgers if info["closed"]}
    replicas = await check_stream_ledgers(history, read, c.metadata_url, closed)
    assert replicas.ok, f"seed {seed} ({what}): {replicas}"
