"""Recovery against a writer that is still alive, on real processes, scripted through proxies
and recovery's phases: the split brain of BookKeeper #2614 (found with its TLA+ spec),
recovery inside the last segment (BookKeeper #2615) and an I/O error that is not
"no such entry" (BookKeeper #2908).

The split brain runs twice per seed: with fencing recovery reads the checker finds nothing;
with ``_unsafe_unfenced_recovery_reads=True`` it must find the acknowledged entry the recovery
cut off, which proves the test can see the bug it guards against."""

from __future__ import annotations

import asyncio
import json
import random
import signal
from pathlib import Path
from typing import Any

import pytest

from node.client import Client, RecoveryFailed
from node.jepsen.checker import Verdict, check_cluster
from node.jepsen.history import History, Op, merge
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
MODES = {False: "fencing reads", True: "unfenced reads (the bug)"}
JUST_AFTER_THE_CHANGE = 3  # the seed whose writer dies as the ensemble changes
POLL_S = 0.05  # between two reads of the metadata a test waits on
OUTCOME_TIMEOUT_S = 30.0  # for the old writer's add to end once its held traffic flows


class SplitBrain:
    """The schedule of BookKeeper #2614 with E=Qw=3, Qa=2 on B1, B2, B3 (a seeded order of
    the ensemble),
    the old writer W and the recoverer R each behind their own proxies:

    1. W adds entry k (after k ok entries): only B2 gets it (W->B1, W->B3 held) and acks.
    2. R's fencing LAC reads: the one to B3 is lost (B3 is not fenced by it); B1 and B2 cover.
    3. R's recovery read of entry k: the one to B2 is held; B1 and B3 say "no such entry", which
       is Qw-Qa+1 = 2 "absent" answers: R closes at k-1.
    4. W's held add reaches B3: if R's read fenced B3, W gets "fenced" (its add is unknown,
       nothing lost); if not, B3 acks, W has Qa acks and reports entry k ok: lost."""

    def __init__(self, cluster: LocalCluster, mesh: ProxyMesh, seed: int, unsafe: bool) -> None:
        self.cluster = cluster
        self.mesh = mesh
        self.rng = random.Random(seed)
        self.unsafe = unsafe
        self.recoverer = History("r")
        self.b1 = self.b2 = self.b3 = ""

    def place(self, ensemble: list[str]) -> None:
        self.b1, self.b2, self.b3 = self.rng.sample(ensemble, 3)

    def isolate_w(self) -> None:
        self.mesh["w", self.b1].hold(Direction.UP)
        self.mesh["w", self.b3].hold(Direction.UP)

    async def recover(self, ledger_id: int) -> int:
        mesh = self.mesh
        overrides = await mesh.for_client("r")
        mesh["r", self.b3].drop(Direction.UP)

        async def phase(name: str, info: dict[str, Any]) -> None:
            if name == "lac_read":
                assert self.b3 not in info["answers"], "B3's LAC read was to be lost"
                mesh["r", self.b2].hold(Direction.UP)
                mesh["r", self.b3].heal(keep_cut=True)  # the lost fence stays lost

        async with Client(
            self.cluster.metadata_url,
            address_override=overrides,
            _unsafe_unfenced_recovery_reads=self.unsafe,
        ) as client:
            meta = await recover(client, self.recoverer, ledger_id, phase)
        return int(meta["lastEntryId"])

    def release_w_to_b3(self) -> None:
        self.mesh["w", self.b3].release()

    def release_w_to_b1(self) -> None:
        self.mesh["w", self.b1].release()

    async def verdict(self, writer_ops: list[Op]) -> Verdict:
        for node in self.cluster.node_ids:
            self.mesh["r", node].set(RESET)  # R's held read of entry k never arrives
        return await check_cluster(merge(writer_ops, self.recoverer.ops), self.cluster.metadata_url)


def assert_outcome(unsafe: bool, k: int, closed_at: int, outcome: str, verdict: Verdict) -> None:
    assert closed_at == k - 1, "the recovery was to find entry k absent"
    if unsafe:
        assert outcome == "ok", "without fencing reads the old writer reaches Qa"
        assert "short" in verdict.kinds(), verdict
        assert {v.entry for v in verdict.violations if v.kind == "short"} == {k}
    else:
        assert outcome == "info", "the fenced add's outcome is unknown, never ok"
        assert verdict.ok, verdict


@pytest.mark.parametrize("unsafe", list(MODES), ids=list(MODES.values()))
@pytest.mark.parametrize("seed", SEEDS)
async def test_split_brain_the_old_writer_s_add_is_fenced_and_nothing_acknowledged_is_lost(
    cluster: LocalCluster, mesh: ProxyMesh, seed: int, unsafe: bool
) -> None:
    brain = SplitBrain(cluster, mesh, seed, unsafe)
    history = History("w")
    overrides = await mesh.for_client("w")
    async with Client(cluster.metadata_url, address_override=overrides) as client:
        writer = await Writer.create(client, history, brain.rng, 3, 3, 2)
        k = brain.rng.randint(0, 4)
        for _ in range(k):
            assert await writer.add() >= 0
        brain.place(await last_ensemble(client, writer.ledger.id))
        brain.isolate_w()
        b2_stored = answered(mesh["w", brain.b2])
        add = asyncio.ensure_future(writer.add())
        await until(b2_stored, f"entry {k} on B2")
        closed_at = await brain.recover(writer.ledger.id)
        brain.release_w_to_b3()
        await asyncio.wait_for(asyncio.shield(add), OUTCOME_TIMEOUT_S)
        brain.release_w_to_b1()
    outcome = next(op.type for op in reversed(history.ops) if op.f == "add")
    assert_outcome(unsafe, k, closed_at, outcome, await brain.verdict(history.ops))


@pytest.mark.parametrize(
    ("seed", "unsafe"), [(1, False), (2, False), (3, False), (1, True)], ids=str
)
async def test_split_brain_with_the_old_writer_paused(
    cluster: LocalCluster, mesh: ProxyMesh, tmp_path: Path, seed: int, unsafe: bool
) -> None:
    """The same schedule with W a process that is SIGSTOPped while R recovers and SIGCONTed
    after its held add has reached B3 (B3's answer waits in W's socket)."""
    brain = SplitBrain(cluster, mesh, seed, unsafe)
    child, ledger_id = await child_writer(cluster, mesh, tmp_path, seed)
    try:
        k = brain.rng.randint(0, 4)
        if k:
            assert await child.command(f"add {k}") == k - 1
        async with Client(cluster.metadata_url) as client:
            brain.place(await last_ensemble(client, ledger_id))
        brain.isolate_w()
        b2_stored = answered(mesh["w", brain.b2])
        child.send("add 1")
        await until(b2_stored, f"entry {k} on B2")
        child.signal(signal.SIGSTOP)
        closed_at = await brain.recover(ledger_id)
        b3_answered = answered(mesh["w", brain.b3])
        brain.release_w_to_b3()
        await until(b3_answered, "B3's answer to the old writer")
        child.signal(signal.SIGCONT)
        last = await asyncio.wait_for(child.answer(), OUTCOME_TIMEOUT_S)
        brain.release_w_to_b1()
        assert await child.finish() == 0
    finally:
        child.signal(signal.SIGCONT)
        await child.kill()
    ops = await writer_history(child)
    outcome = next(op.type for op in reversed(ops) if op.f == "add")
    assert (last == k) == (outcome == "ok")
    assert_outcome(unsafe, k, closed_at, outcome, await brain.verdict(ops))


async def segments_of(cluster: LocalCluster, ledger_id: int, count: int) -> None:
    """Waits until the ledger's metadata has ``count`` segments."""
    async with Client(cluster.metadata_url) as client:
        for _ in range(int(OUTCOME_TIMEOUT_S / POLL_S)):
            if len((await client.ledger_metadata(ledger_id))["segments"]) >= count:
                return
            await asyncio.sleep(POLL_S)
    raise AssertionError(f"ledger {ledger_id}: no {count} segments in {OUTCOME_TIMEOUT_S} s")


@pytest.mark.parametrize("seed", SEEDS)
async def test_recovery_stays_in_the_last_segment(
    make_cluster: MakeCluster, tmp_path: Path, seed: int
) -> None:
    """BookKeeper #2615: E=Qw=3, Qa=2 on four nodes. The writer adds 10 entries, a node of the
    ensemble is
    killed, the writer goes on in a new segment at 10 and is SIGKILLed a few entries later
    (with one seed: as soon as the new segment is in the metadata, before entry 10 reached any
    node, so that every LAC answer is 8 and only the segment bound starts recovery at 9).
    The removed node comes back (it answers, with old data and a low LAC): recovery starts
    at the last segment's first entry - 1 or later, asks only the last segment's nodes (none
    of its requests reaches the removed node's proxy) and keeps every acknowledged entry."""
    rng = random.Random(seed)
    cluster = await asyncio.to_thread(make_cluster, 4)
    mesh = ProxyMesh({n: cluster.url(n) for n in cluster.node_ids})
    try:
        child, ledger_id = await child_writer(cluster, mesh, tmp_path, seed)
        try:
            assert await child.command("add 10") == 9
            async with Client(cluster.metadata_url) as client:
                removed = rng.choice(await last_ensemble(client, ledger_id))
            await asyncio.to_thread(cluster.kill, removed)
            after = 0 if seed == JUST_AFTER_THE_CHANGE else rng.randint(1, 6)
            if after:
                assert await child.command(f"add {after}") == 9 + after
                # The failed node's error may come after the adds' Qa acks (BookKeeper #1390:
                # the ensemble changes anyway): wait for the change before the writer dies.
                await segments_of(cluster, ledger_id, 2)
                child.send(f"spawn {rng.randint(0, 3)}")  # adds in flight when it dies
            else:  # entry 10 changes the ensemble and reaches no node: the LACs stay at 8
                for node in cluster.node_ids:
                    mesh["w", node].hold(Direction.UP)
                child.send("spawn 1")
                await segments_of(cluster, ledger_id, 2)
        finally:
            await child.kill()
        await asyncio.to_thread(cluster.start, removed)
        recoverer = History("r")
        phases: dict[str, Any] = {}

        async def phase(name: str, info: dict[str, Any]) -> None:
            phases.setdefault(name, info)

        overrides = await mesh.for_client("r")
        async with Client(cluster.metadata_url, address_override=overrides) as client:
            segments = (await client.ledger_metadata(ledger_id))["segments"]
            assert len(segments) == 2 and segments[0]["firstEntryId"] == 0
            # At 10, or later when the failure was seen after some of the `after` adds' acks.
            second = segments[1]["firstEntryId"]
            assert 10 <= second <= 10 + after
            assert removed not in segments[-1]["ensemble"]
            meta = await recover(client, recoverer, ledger_id, phase)
        assert phases["lac_read"]["start"] >= second - 1
        if not after:  # the replicas' LAC alone would start recovery in the removed segment
            assert phases["lac_read"]["lac"] < 9
        assert removed not in phases["lac_read"]["answers"]
        assert mesh["r", removed].counters.requests == [], "a recovery request went to it"
        assert meta["lastEntryId"] >= 9 + after
        ops = merge(await writer_history(child), recoverer.ops)
        verdict = await check_cluster(ops, cluster.metadata_url)
        assert verdict.ok, verdict
    finally:
        await mesh.close()


@pytest.mark.parametrize("seed", SEEDS)
async def test_an_io_error_on_a_replica_is_not_no_such_entry(
    cluster: LocalCluster, mesh: ProxyMesh, tmp_path: Path, seed: int
) -> None:
    """BookKeeper #2908: E=Qw=3, Qa=2 on X, Y, Z. Entries past k reach X and Y only
    (acknowledged). The
    writer is SIGKILLed; X restarts with every entry-log read failing (EIO), Y is down. For
    the last entries X's answer is an error, Z's is "no such entry", Y's none: recovery must
    fail (not close short: counting X's error as "absent" would make 2 = Qw-Qa+1). With Y back
    it closes after every acknowledged entry."""
    rng = random.Random(seed)
    child, ledger_id = await child_writer(cluster, mesh, tmp_path, seed)
    try:
        k = rng.randint(1, 5)
        assert await child.command(f"add {k}") == k - 1
        async with Client(cluster.metadata_url) as client:
            x, y, z = rng.sample(await last_ensemble(client, ledger_id), 3)
        mesh["w", z].hold(Direction.UP)
        more = rng.randint(1, 4)
        assert await child.command(f"add {more}") == k + more - 1
    finally:
        await child.kill()
    mesh["w", z].set(RESET)
    # A clean stop flushes X's entries to its entry logs, where the restarted X must read them.
    await asyncio.to_thread(cluster.terminate, x)
    faults = {"NODE_FAULTS": json.dumps(["entrylog.read=eio"])}
    await asyncio.to_thread(cluster.start, x, faults)
    await asyncio.to_thread(cluster.kill, y)
    recoverer = History("r")
    async with Client(cluster.metadata_url) as client:
        with pytest.raises(RecoveryFailed, match="io_error"):
            await recover(client, recoverer, ledger_id)
        assert (await client.ledger_metadata(ledger_id))["state"] == "IN_RECOVERY"
    await asyncio.to_thread(cluster.start, y)
    async with Client(cluster.metadata_url) as client:
        meta = await recover(client, recoverer, ledger_id)
    assert meta["lastEntryId"] == k + more - 1
    ops = merge(await writer_history(child), recoverer.ops)
    verdict = await check_cluster(ops, cluster.metadata_url)
    assert verdict.ok, verdict
