"""Exactly-once appends under faults, judged by the stream checker (node/jepsen/streams.py):
writers are producers (X-Producer-Id, X-Sequence-Id) that retry every append not
acknowledged with the same payloads and ids until it is; the node is SIGKILLed with appends
in flight and started again on its data (its WAL). Afterwards each payload is in the stream
exactly once, at the position every acknowledgment of it named."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from node.jepsen.history import Op
from node.jepsen.streams import StreamWorkload, check_stream, read_back
from tests.harness.node import NodeProcess
from tests.harness.streams import put_stream, sigkill_and_restart

STREAM = "orders"
ENV = {"NODE_RETENTION_SCHEDULER_ENABLED": "false"}
TIMEOUT_S = 1.0  # a producer's wait for an answer; then it sends the append again
SLOW_FSYNC_S = 2.0
POLICIES = {"deduplication": True, "maxEntriesPerLedger": 30, "minLedgerRolloverTimeMinutes": 0}


async def started(data: Path, env: dict[str, str] | None = None) -> NodeProcess:
    node = NodeProcess(data, {**ENV, **(env or {})})
    await asyncio.to_thread(node.start)
    return node


def unacked_payloads(history: list[Op]) -> set[str]:
    """The payloads some append carried that no acknowledgment covers."""
    invoked = {d for op in history if op.f.startswith("append") for d in op.digests()}
    acked = {d for op in history if op.type == "ok" and op.f.startswith("append")
             for d in op.digests()}  # fmt: skip
    return invoked - acked


def retried_after(history: list[Op], when: float) -> int:
    """Appends answered other than ok after ``when`` whose payloads were acknowledged later."""
    acked = {tuple(op.digests()) for op in history if op.type == "ok"}
    return sum(
        1
        for op in history
        if op.f.startswith("append") and op.type in ("info", "fail") and op.t > when
        and tuple(op.digests()) in acked
    )  # fmt: skip


async def test_producers_retrying_through_a_kill_land_each_append_once(tmp_path: Path) -> None:
    """Four producers (singles and batches, ledgers rolling every 30 entries, a snapshot
    every 7 entries so that the restart reads a snapshot and the entries after it); the node
    is SIGKILLed with appends in flight and started again; every append is retried with its
    ids until acknowledged. Two WAL fsyncs of the first run take longer than the producers
    wait: the appends they carry are retried while in flight, and after they landed."""
    env = {
        "NODE_STREAM_DEDUP_SNAPSHOT_INTERVAL_ENTRIES": "7",
        "NODE_FAULTS": json.dumps([f"journal.fsync=delay:{SLOW_FSYNC_S},after=10,times=2"]),
    }
    node = await started(tmp_path / "data", env)
    status, body = await put_stream(node.url, STREAM, POLICIES)
    assert status == 201, body
    async with StreamWorkload(
        [node.url], STREAM, writers=4, batch_max=3, seed=5, producers=True, timeout_s=TIMEOUT_S
    ) as load:
        load.start()
        await load.wait_acked(60)
        before = load.acked
        again, killed_at = await sigkill_and_restart(
            load, node, lambda: started(tmp_path / "data", {**env, "NODE_FAULTS": "[]"})
        )
        await load.wait_acked(before + 60)
        await load.stop()
    history = load.history()
    read = await read_back(again.url, STREAM)
    verdict = check_stream(history, read)
    assert verdict.ok, str(verdict)
    assert retried_after(history, killed_at) > 0, load.outcomes
    assert load.outcomes.get("200", 0) >= 1, load.outcomes  # the slow fsyncs' retries
    assert not unacked_payloads(history), (unacked_payloads(history), load.outcomes)
    assert verdict.counts["read"] == len({d for op in history for d in op.digests()})
    assert len({p.split(":")[0] for p, _ in read}) >= 3  # across rollovers
