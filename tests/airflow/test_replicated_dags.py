"""dag.test() runs of the offload and retention DAGs against replicated streams: etcd and four
node processes sharing one object store (a local directory, as one S3 bucket would be), four
3/3/2 streams each created through a different node (its creator owns it). The fourth node is
then SIGKILLed and left out of discovery (as Kubernetes discovery leaves out a pod that is not
Ready): its stream has no live owner, and no client asks for it. Each node's run acts on the
streams it owns, after taking over the ones nobody owns (one node takes each):

- offload: every stream's closed ledgers go to the store, each by its owner, once (one
  attempt per ledger in the store); with no deletion lag their replicas leave every node;
  every acknowledged append still reads back, through a node that does not own the stream;
- retention: each owner trims what its stream's policies say (no cursor and a retention
  time of 0: every closed ledger; a cursor: only what it consumed; unlimited: nothing); the
  trimmed ledgers leave the record, their objects leave the store, their metadata and
  doomed keys leave etcd; the rest reads back."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from node.jepsen.history import Op
from node.jepsen.streams import StreamWorkload, check_stream, read_back
from node.localcluster import LocalCluster
from node.offload.format import parse_key
from tests.airflow.conftest import Airflow
from tests.harness.cluster import MakeCluster, make_cluster
from tests.harness.streams import (
    REPLICATED,
    call,
    etcd_keys,
    ledger_leftovers,
    node_ledger_ids,
    owner,
    put_stream,
    stream_ledgers,
    wait_owner,
)
from tests.streams.conftest import STREAM_CLUSTER_ENV

__all__ = ["make_cluster"]  # the fixture: etcd and node processes under the test's tmp_path

NODES = 4
ROLLOVER = {"maxEntriesPerLedger": 4, "minLedgerRolloverTimeMinutes": 0}
# Every closed ledger goes to the store, and its replicas right after.
OFFLOAD_NOW = {"offloadThresholdInBytes": 0, "offloadDeletionLagInMillis": 0}
# stream -> (the node that creates and owns it, its retention policies)
STREAMS: dict[str, tuple[str, dict[str, int]]] = {
    "trimmed": ("n0", {"retentionTimeInMinutes": 0}),  # no cursor: every closed ledger goes
    "consumed": ("n1", {"retentionTimeInMinutes": 0}),  # a cursor: what it consumed goes
    "kept": ("n2", {"retentionTimeInMinutes": -1}),  # unlimited: nothing goes
    "orphaned": ("n3", {"retentionTimeInMinutes": 0}),  # its owner dies: taken over
}
LOST = "n3"
APPENDS = 8  # per writer, two writers: 16 entries, ledgers of 4
GONE_TIMEOUT_S = 60.0  # for every node's GC sweep to reclaim dropped replicas


def run_dag(airflow: Airflow, dag_id: str, urls: list[str]) -> dict[str, Any]:
    done = airflow.run(
        "test",
        dag_id,
        "{}",
        variables={"storage_node_discovery": {"kind": "static", "urls": urls}},
    )
    result: dict[str, Any] = done.result
    assert result["state"] == "success", done.output[-6000:]
    return result


def by_node(result: dict[str, Any], task_id: str) -> dict[str, dict[str, Any]]:
    """Each mapped task's XCom, by the node it ran against."""
    found = {}
    for task in result["tasks"]:
        if task["taskId"] == task_id:
            assert task["state"] == "success", task
            found[task["xcom"]["node"]] = task["xcom"]
    return found


async def stored_objects(shared: Path) -> list[tuple[int, str]]:
    """(ledger id, attempt) of every offload data object in the shared store."""

    def listing() -> list[tuple[int, str]]:
        keys = [str(p.relative_to(shared)) for p in shared.rglob("*.data") if p.is_file()]
        return sorted(k for k in map(parse_key, keys) if k is not None)

    return await asyncio.to_thread(listing)


async def until_true(condition: Any, what: str, timeout_s: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await condition():
        assert loop.time() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.2)


def clean(history: list[Op], read: list[tuple[str, bytes]]) -> None:
    verdict = check_stream(history, read)
    assert verdict.ok, str(verdict)


async def test_offload_and_retention_dags_act_on_each_owners_replicated_streams(
    airflow: Airflow, make_cluster: MakeCluster, tmp_path: Path
) -> None:
    shared = tmp_path / "objects"
    env = {**STREAM_CLUSTER_ENV, "NODE_OFFLOAD_LOCAL_DIR": str(shared)}
    c: LocalCluster = await asyncio.to_thread(make_cluster, nodes=NODES, env=env)
    everyone = [c.url(n) for n in c.node_ids]
    live = [n for n in c.node_ids if n != LOST]
    urls = sorted(c.url(n) for n in live)
    node_of = {c.url(n): n for n in live}
    histories: dict[str, list[Op]] = {}
    for name, (creator, retention) in STREAMS.items():
        body = {"replication": REPLICATED, **ROLLOVER, **OFFLOAD_NOW, **retention}
        status, reply = await put_stream(c.url(creator), name, body)
        assert status == 201 and reply["owner"] == creator, (status, reply)
        # Appends through every node (three of four forwarded to the owner).
        async with StreamWorkload(everyone, name, writers=2, prefix=name[0]) as load:
            load.start(operations=APPENDS)
            await load.join()
        assert load.acked == 2 * APPENDS, load.outcomes
        histories[name] = load.history()
    closed = {
        name: {i["id"] for i in await stream_ledgers(c, name) if i["closed"]} for name in STREAMS
    }
    assert all(len(ids) >= 3 for ids in closed.values()), closed
    await asyncio.to_thread(c.kill, LOST)
    await wait_owner(c, "orphaned", {None})  # its lease ran out: nobody owns it now

    # --- offload ---------------------------------------------------------------------------
    # A run naming a stream, sent to a node that does not own it, is the owner's (a dry run).
    status, reply = await call(
        "POST", f"{c.url('n2')}/api/v1/offload/run?dryRun=true", {"stream": "trimmed"}
    )
    assert status == 200 and set(reply["offloaded"]) == closed["trimmed"], (status, reply)
    offload = await asyncio.to_thread(run_dag, airflow, "storage_node_offload", urls)
    results = by_node(offload, "run_offload")
    assert sorted(results) == urls  # discovery visited every node
    owners = {name: await owner(c, name) for name in STREAMS}
    assert owners["orphaned"] in live, owners  # taken over by one of the runs
    for name, (creator, _) in STREAMS.items():
        if name != "orphaned":
            assert owners[name] == creator, owners  # no run took a live owner's stream
    # The takeover closed the orphan's last ledger, at its last entry: closed too now.
    before = closed["orphaned"]
    closed["orphaned"] = {i["id"] for i in await stream_ledgers(c, "orphaned") if i["closed"]}
    assert before < closed["orphaned"], (before, closed["orphaned"])
    for url, result in results.items():
        owned = {name for name, node_id in owners.items() if node_id == node_of[url]}
        mine = set().union(*[closed[n] for n in owned])
        # Each owner offloaded its streams' closed ledgers and dropped their replicas; a
        # node offloads nothing of a stream it does not own (the idle one: nothing at all).
        assert set(result["offloaded"]) == mine, (url, result, closed)
        assert set(result["localDeleted"]) == mine, (url, result)
        assert result["failed"] == [] and result["refused"] is None, result
    every_closed = set().union(*closed.values())
    objects = await stored_objects(shared)
    assert sorted(lid for lid, _ in objects) == sorted(every_closed), objects  # once each
    for name in STREAMS:
        for info in await stream_ledgers(c, name):
            if info["id"] in closed[name]:
                offloaded: Any = info["offload"]
                assert offloaded["state"] == "offloaded" and offloaded["replicasDeleted"], info
                assert (info["id"], offloaded["attempt"]) in objects, (info, objects)
            else:
                assert "offload" not in info, info

    async def replicas_gone() -> bool:
        return not await ledger_leftovers(c, every_closed)

    await until_true(replicas_gone, "the offloaded ledgers' replicas reclaimed", GONE_TIMEOUT_S)
    for name in STREAMS:
        reader = c.url(next(n for n in live if n != owners[name]))
        clean(histories[name], await read_back(reader, name))  # from the store, through it

    # --- retention -------------------------------------------------------------------------
    # The "consumed" stream's cursor acknowledges its first closed ledger whole and part of
    # the second: retention may take the first only.
    first, second = sorted(closed["consumed"])[:2]
    mark = f"{second}:1"
    cursor = f"{c.url('n0')}/api/v1/streams/consumed/cursors/billing"
    status, reply = await call("PUT", cursor, {"start": "earliest"})
    assert status == 201, reply
    status, reply = await call("POST", f"{cursor}/ack", {"position": mark})
    assert status == 200, reply
    for name in STREAMS:  # read_back's cursors, which read everything, go
        checker = f"{c.url('n2')}/api/v1/streams/{name}/cursors/checker"
        status, reply = await call("DELETE", checker)
        assert status == 204, (name, status, reply)

    retention = await asyncio.to_thread(run_dag, airflow, "storage_node_retention", urls)
    results = by_node(retention, "run_retention")
    assert sorted(results) == urls
    dropped: dict[str, set[int]] = {}
    for url, result in results.items():
        owned = {name for name, node_id in owners.items() if node_id == node_of[url]}
        assert set(result["deletedLedgers"]) <= owned, (url, result)  # its own streams only
        for name, ids in result["deletedLedgers"].items():
            dropped[name] = set(ids)
    # No cursor, retention time 0: every closed ledger (and maybe the full last one, which
    # the run rolls over first).
    assert closed["trimmed"] <= dropped["trimmed"], dropped
    assert closed["orphaned"] <= dropped["orphaned"], dropped
    assert dropped["consumed"] == {first}, dropped
    assert "kept" not in dropped, dropped
    for name, ids in dropped.items():
        remaining = {i["id"] for i in await stream_ledgers(c, name)}
        assert remaining and not remaining & ids, (name, remaining, ids)
    gone = set().union(*dropped.values())
    objects = await stored_objects(shared)
    assert {lid for lid, _ in objects} == every_closed - gone, (objects, gone)
    assert await etcd_keys(c, "stream-doomed/") == []

    async def trimmed_gone() -> bool:
        return not await ledger_leftovers(c, gone)

    await until_true(trimmed_gone, "the trimmed ledgers' metadata and replicas", GONE_TIMEOUT_S)
    for name in STREAMS:
        reader = c.url(next(n for n in live if n != owners[name]))
        read = await read_back(reader, name, cursor="after")
        # The acknowledgments into trimmed ledgers are left out (their invocations stay, as
        # appends of unknown outcome that are now absent).
        ids = dropped.get(name, set())
        kept = [op for op in histories[name] if op.type != "ok" or op.ledger not in ids]
        clean(kept, read)
        if name in ("consumed", "kept"):
            assert read, name
    # Nothing of a trimmed ledger on any live node.
    for node_id in live:
        assert not await node_ledger_ids(c.url(node_id)) & gone, node_id
