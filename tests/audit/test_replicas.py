"""The ``replicas`` check on a real fleet: three node processes under a real etcd, replicated
ledgers written by the client (3/3/2 and 3/2/2, closed; 3/3/2 left open). The live nodes'
snapshots, each carrying the ledgers' metadata read just before it, audit clean. Then, the
nodes stopped: one copy with a flipped byte, one copy rewritten with other bytes and a CRC32C
that checks out, and one node's replica of a whole ledger deleted from its index. The check
names each copy on its node with its kind, and the single-node checks see only what is
theirs (the flipped byte, in ``crc``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from node.audit import CHECKS, fleet, job, snapshot
from node.client.model import LedgerState
from node.localcluster import LocalCluster
from tests.audit import world as w
from tests.harness.cluster import cluster_env

pytestmark = pytest.mark.timeout(600)

ENTRIES = 12
SPLIT_BYTES = 16 * 1024
FLIPPED = 3  # entry of the 3/3/2 ledger whose copy on FLIP_NODE gets a flipped byte
REWRITTEN = 5  # entry of the same ledger rewritten (consistently) on REWRITE_NODE
FLIP_NODE, REWRITE_NODE, DELETE_NODE = "n1", "n0", "n2"


@dataclass
class Fleet:
    cluster: LocalCluster
    closed33: int
    closed22: int
    open33: int


@pytest.fixture(scope="module")
def fleet_of_three(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("replicas") / "cluster"
    cluster = LocalCluster(root, nodes=3, env=cluster_env())
    try:
        ids = w.write_ledgers(
            cluster, [(3, 3, 2, True), (3, 2, 2, True), (3, 3, 2, False)], ENTRIES
        )
        yield Fleet(cluster, *ids)
    finally:
        cluster.close()


def _rows(out: Path, check: str) -> list[dict[str, Any]]:
    return list(pq.read_table(out / f"{check}.parquet").to_pylist())


def _audit(spark: Any, out: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    args = job.build_parser().parse_args(
        ["--out", str(out), "--split-bytes", str(SPLIT_BYTES), *extra]
    )
    status = job.run(args, spark)
    return status, w.read_json(out / job.SUMMARY_FILE)


def test_live_snapshots_of_a_clean_fleet_report_nothing(
    fleet_of_three: Fleet, spark: Any, tmp_path: Path
) -> None:
    cluster = fleet_of_three.cluster
    uris = []
    for node in cluster.node_ids:
        taken = w.post_json(f"{cluster.url(node)}/api/v1/audit/snapshot", {})
        directory = snapshot.fetch(taken["uri"])
        meta = json.loads((directory / "snapshot.json").read_text())
        assert meta["nodeId"] == node
        assert meta["ledgersFile"] == fleet.LEDGERS_FILE and meta["ledgersError"] is None
        uris.append(taken["uri"])
    status, summary = _audit(spark, tmp_path / "out", *[p for u in uris for p in ("--snapshot", u)])
    assert {name: r["violations"] for name, r in summary["checks"].items()} == dict.fromkeys(
        CHECKS, 0
    )
    assert status == job.EXIT_CLEAN
    # Three ledgers seen by three nodes; every node is in every (single) segment; the open
    # ledger's last segment was cut at its replicas' writer LAC, which covers some entries.
    assert summary["replicas"] == {
        "ledgers": 9,
        "ranges": 9,
        "openTailsCut": 3,
        "nodesWithoutSnapshot": [],
        "nodesWithoutLedgers": [],
    }
    assert _rows(tmp_path / "out", "replicas") == []


def test_a_snapshot_the_store_could_not_serve_says_so(
    fleet_of_three: Fleet, spark: Any, tmp_path: Path
) -> None:
    """etcd down while one node snapshots: its snapshot comes without the metadata (and says
    why); the check still runs over the others and names the node it could not check."""
    cluster = fleet_of_three.cluster
    cluster.kill_etcd()
    try:
        blind = w.post_json(f"{cluster.url('n0')}/api/v1/audit/snapshot", {})
    finally:
        cluster.restart_etcd()
    meta = json.loads((snapshot.fetch(blind["uri"]) / "snapshot.json").read_text())
    assert meta["nodeId"] == "n0" and meta["ledgersFile"] is None and meta["ledgersError"]
    uris = [blind["uri"]]
    for node in ("n1", "n2"):
        uris.append(w.post_json(f"{cluster.url(node)}/api/v1/audit/snapshot", {})["uri"])
    args = [p for u in uris for p in ("--snapshot", u)]
    status, summary = _audit(spark, tmp_path / "out", "--checks", "replicas", *args)
    assert status == job.EXIT_CLEAN
    assert summary["replicas"]["nodesWithoutLedgers"] == ["n0"]
    assert summary["replicas"]["ranges"] == 6  # n1 and n2: three ledgers each


def test_flipped_rewritten_and_missing_copies_are_named(
    fleet_of_three: Fleet, spark: Any, tmp_path: Path
) -> None:
    f = fleet_of_three
    cluster = f.cluster
    metas = w.ledger_metadata(cluster)
    assert metas[f.closed33].state is LedgerState.CLOSED
    assert metas[f.open33].state is LedgerState.OPEN
    for node in cluster.node_ids:
        cluster.terminate(node)  # a clean stop: everything in the entry logs
    data = {node: cluster.node(node).data_dir for node in cluster.node_ids}
    w.flip_payload_byte(w.World(data[FLIP_NODE]), f.closed33, FLIPPED)
    w.rewrite_payload_byte(data[REWRITE_NODE], f.closed33, REWRITTEN)
    assert w.delete_ledger_replica(data[DELETE_NODE], f.closed22) > 0
    uris = []
    for node, directory in data.items():
        snap = snapshot.from_data_dir(directory, node=f"{node}-stopped")
        assert snap.node_id == node  # from the data directory's cookie
        uris.append(snapshot.write_dir(snap, tmp_path / "snapshots" / node))
    out = tmp_path / "out"
    status, summary = _audit(
        spark,
        out,
        "--metadata-url",
        cluster.metadata_url,
        *[p for u in uris for p in ("--snapshot", u)],
    )
    assert status == job.EXIT_VIOLATIONS
    lost = [e for e in range(ENTRIES) if DELETE_NODE in metas[f.closed22].write_set(e)]
    assert lost and len(lost) < ENTRIES  # 3/2/2: the node held two entries in three
    found = {
        (r["node_id"], r["node"], r["ledger_id"], r["entry_id"], r["kind"])
        for r in _rows(out, "replicas")
    }
    assert found == {
        (FLIP_NODE, f"{FLIP_NODE}-stopped", f.closed33, FLIPPED, "crc_mismatch"),
        (REWRITE_NODE, f"{REWRITE_NODE}-stopped", f.closed33, REWRITTEN, "crc_mismatch"),
        *{(DELETE_NODE, f"{DELETE_NODE}-stopped", f.closed22, e, "missing") for e in lost},
    }
    whats = {(r["node_id"], r["entry_id"]): r["what"] for r in _rows(out, "replicas")}
    assert "fails its own check" in whats[(FLIP_NODE, FLIPPED)]
    assert "2 of 3 copies" in whats[(FLIP_NODE, FLIPPED)]
    assert "fails its own check" not in whats[(REWRITE_NODE, REWRITTEN)]
    assert whats[(DELETE_NODE, lost[0])].startswith(f"missing: node {DELETE_NODE} holds no copy")
    # The single-node checks: the flipped byte is the crc check's too; nothing else shows.
    counts = {name: r["violations"] for name, r in summary["checks"].items()}
    assert counts == {**dict.fromkeys(CHECKS, 0), "crc": 1, "replicas": 2 + len(lost)}
    assert [(r["node"], r["ledger_id"], r["entry_id"]) for r in _rows(out, "crc")] == [
        (f"{FLIP_NODE}-stopped", f.closed33, FLIPPED)
    ]
    assert summary["replicas"]["nodesWithoutLedgers"] == []
    assert (out / fleet.LEDGERS_FILE).is_file()  # the dump the check used
