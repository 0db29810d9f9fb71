"""A node or the writer dies mid-write, on real processes (etcd and nodes on loopback): every
acknowledged entry survives, byte for byte, and every reader agrees where the ledger ends.
Each scenario runs with three seeds (the moment of the fault, the ledger's shape)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from node.client import Client
from node.jepsen.checker import check_cluster
from node.jepsen.history import History, merge
from node.jepsen.proxy import RESET, Direction, ProxyMesh
from node.jepsen.workload import Writer, recover
from node.localcluster import LocalCluster
from tests.harness.cluster import (
    MakeCluster,
    answered,
    child_writer,
    last_ensemble,
    until,
    writer_history,
)

SEEDS = [1, 2, 3]
SHAPES = {1: (3, 3, 2), 2: (3, 2, 2), 3: (3, 3, 2)}  # (E, Qw, Qa) by seed: one striped
IN_FLIGHT = 4  # adds the writer has out when the node dies
AFTER_KILL = 20  # adds after the kill, all of which must succeed


@pytest.mark.parametrize("seed", SEEDS)
async def test_a_node_killed_mid_write_is_replaced_and_the_writer_goes_on(
    make_cluster: MakeCluster, seed: int
) -> None:
    rng = random.Random(seed)
    cluster = await asyncio.to_thread(make_cluster, 4)
    e, wq, aq = SHAPES[seed]
    history = History("w")
    async with Client(cluster.metadata_url, rng=random.Random(seed)) as client:
        writer = await Writer.create(client, history, rng, e, wq, aq)
        for _ in range(rng.randint(3, 12)):
            assert await writer.add() >= 0
        victim = rng.choice(await last_ensemble(client, writer.ledger.id))
        writer.spawn(IN_FLIGHT)
        await asyncio.to_thread(cluster.kill, victim)
        await writer.wait_pending()
        for _ in range(AFTER_KILL):
            assert await writer.add() >= 0, "an add after the node's death failed"
        assert await writer.close() == writer.last_ok
        meta = await client.ledger_metadata(writer.ledger.id)
    assert len(meta["segments"]) >= 2, "no ensemble change"
    assert victim not in meta["segments"][-1]["ensemble"]
    assert not [op for op in history.ops if op.type in ("fail", "info")]
    verdict = await check_cluster(history.ops, cluster.metadata_url)  # the victim stays dead
    assert verdict.ok, verdict


@pytest.mark.parametrize("seed", SEEDS)
async def test_a_killed_writer_s_entries_at_qa_minus_1_and_qa_copies_are_recovered(
    cluster: LocalCluster, mesh: ProxyMesh, tmp_path: Path, seed: int
) -> None:
    """E=Qw=3, Qa=2 on nodes A, B, C. After k ok entries: entry k reaches A and B, but B's
    answer is held (Qa copies, not acknowledged); entry k+1 reaches A only (Qa-1 copies). The
    writer process is SIGKILLed; a recovery from this process closes at k+1 or later: an entry
    any replica returns is kept."""
    rng = random.Random(seed)
    child, ledger_id = await child_writer(cluster, mesh, tmp_path, seed)
    try:
        k = rng.randint(1, 8)
        assert await child.command(f"add {k}") == k - 1
        async with Client(cluster.metadata_url) as client:
            a, b, c = rng.sample(await last_ensemble(client, ledger_id), 3)
        mesh["w", c].hold(Direction.UP)
        mesh["w", b].hold(Direction.DOWN)
        stored_on_a, stored_on_b = answered(mesh["w", a]), answered(mesh["w", b])
        assert await child.command("spawn 1") == 0
        await until(lambda: stored_on_a() and stored_on_b(), f"entry {k} on {a} and {b}")
        mesh["w", b].hold(Direction.UP)
        stored_on_a = answered(mesh["w", a])
        assert await child.command("spawn 1") == 0
        await until(stored_on_a, f"entry {k + 1} on {a}")
    finally:
        await child.kill()
    for node in cluster.node_ids:
        mesh["w", node].set(RESET)  # what the dead writer had in flight never arrives
    recoverer = History("r")
    async with Client(cluster.metadata_url) as client:
        meta = await recover(client, recoverer, ledger_id)
    assert meta["lastEntryId"] == k + 1
    ops = merge(await writer_history(child), recoverer.ops)
    assert [op.entry for op in ops if op.type == "ok" and op.f == "add"] == list(range(k))
    verdict = await check_cluster(ops, cluster.metadata_url)
    assert verdict.ok, verdict
