"""A stream on a node without a metadata store, as before replication: the stream workload and
checker of node/jepsen/streams.py against a real node process, SIGKILLed while appends are in
flight and started again on its data; and the replication settings such a node accepts
(1/1/1 only: anything else is 422 replication_off)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from node.jepsen.streams import StreamWorkload, check_stream, read_back
from tests.harness.node import NodeProcess
from tests.harness.streams import REPLICATED, SINGLE_COPY, call, put_stream, sigkill_and_restart

STREAM = "orders"
ENV = {"NODE_RETENTION_SCHEDULER_ENABLED": "false"}
ROLLOVER = {"maxEntriesPerLedger": 30, "minLedgerRolloverTimeMinutes": 0}


async def started(data: Path) -> NodeProcess:
    node = NodeProcess(data, ENV)
    await asyncio.to_thread(node.start)
    return node


async def test_a_local_stream_survives_a_kill_with_every_acknowledged_append(
    tmp_path: Path,
) -> None:
    """Four writers (singles and batches, ledgers rolling every 30 entries); the node is
    SIGKILLed with appends in flight and started again; the writers go on; a cursor reads
    every acknowledged append back exactly once, in order, where it was acknowledged."""
    node = await started(tmp_path / "data")
    status, body = await put_stream(node.url, STREAM, ROLLOVER)
    assert status == 201, body
    async with StreamWorkload([node.url], STREAM, writers=4, batch_max=4, seed=3) as load:
        load.start()
        await load.wait_acked(60)
        before = load.acked
        again, killed_at = await sigkill_and_restart(load, node, lambda: started(tmp_path / "data"))
        await load.wait_acked(before + 60)
        await load.stop()
    history = load.history()
    assert any(op.type != "ok" and op.t > killed_at for op in history), load.outcomes
    read = await read_back(again.url, STREAM)
    verdict = check_stream(history, read)
    assert verdict.ok, str(verdict)
    assert verdict.counts["acked_entries"] >= 120
    assert len({p.split(":")[0] for p, _ in read}) >= 3  # across rollovers


async def test_a_node_without_a_metadata_store_takes_only_single_copy_streams(
    tmp_path: Path,
) -> None:
    """1/1/1 is its only replication (and its default); 3/3/2 is refused, nothing created."""
    node = await started(tmp_path / "data")
    status, body = await put_stream(node.url, "plain", {"replication": SINGLE_COPY})
    assert status == 201, body
    status, body = await put_stream(node.url, "wide", {"replication": REPLICATED})
    assert status == 422 and body["code"] == "replication_off", body
    status, body = await call("GET", f"{node.url}/api/v1/streams/wide")
    assert status == 404, body
    status, body = await put_stream(node.url, "default", {})
    assert status == 201, body
    async with StreamWorkload([node.url], "default", writers=2) as load:
        load.start(operations=5)
        await load.join()
    assert load.acked == 10, load.outcomes
    assert check_stream(load.history(), await read_back(node.url, "default")).ok
