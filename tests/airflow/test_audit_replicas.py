"""The audit DAG over a replicated fleet (three node processes under etcd): the snapshots it
takes carry each node's fleet id and the ledgers' metadata, so its one spark-submit runs the
fleet-wide replicas check: a flipped byte in one node's copy of one entry fails the run, in
the crc and replicas checks only, and every node keeps that summary."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from node.audit import CHECKS, kept, snapshot
from node.localcluster import LocalCluster
from node.storage import logformat
from tests.airflow.conftest import Airflow
from tests.airflow.test_runs import run_audit
from tests.audit import world as w
from tests.harness.cluster import cluster_env

ENTRIES = 6
FLIPPED = 2  # entry of the 3/3/2 ledger flipped on FLIP_NODE
FLIP_NODE = "n1"
CONNECTION = {"conn_type": "http", "host": "127.0.0.1"}  # the nodes have no admin token


def _run(airflow: Airflow, cluster: LocalCluster, out_dir: Path) -> tuple[Any, dict[str, Any]]:
    urls = sorted(cluster.url(n) for n in cluster.node_ids)
    run = run_audit(airflow, urls, out_dir, CONNECTION)
    [summary_file] = out_dir.glob("*/summary.json")
    return run, json.loads(summary_file.read_text())


def _flip(directory: Path, ledger_id: int, entry_id: int) -> None:
    """Flip a payload byte of the copy a node's snapshot indexes, in the node's own log (the
    snapshot holds a hard link to the same file)."""
    table = pq.read_table(directory / f"locations{kept.PARQUET_SUFFIX}").to_pylist()
    [hit] = [r for r in table if (r["ledger_id"], r["entry_id"]) == (ledger_id, entry_id)]
    meta = json.loads((directory / "snapshot.json").read_text())
    path = logformat.log_path(Path(meta["ledgersDir"]), hit["log_id"])
    with open(path, "r+b") as f:
        f.seek(hit["offset"] + logformat.RECORD_OVERHEAD + w.ENTRY_SIZE // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_the_audit_dag_checks_the_replicas_of_a_fleet(airflow: Airflow, tmp_path: Path) -> None:
    """One DAG run (a clean fleet's run is tests/audit/test_replicas.py's, without Airflow):
    the flipped copy is found by the crc and replicas checks and by nothing else, so the
    rest of the fleet, every replica of every ledger, audited clean in the same run."""
    cluster = LocalCluster(tmp_path / "cluster", nodes=3, env=cluster_env())
    try:
        closed33, _closed22 = w.write_ledgers(cluster, [(3, 3, 2, True), (3, 2, 2, True)], ENTRIES)
        # A snapshot of the node alone, to find where its copy of the entry is.
        taken = w.post_json(f"{cluster.url(FLIP_NODE)}/api/v1/audit/snapshot", {})
        _flip(snapshot.fetch(taken["uri"]), closed33, FLIPPED)

        run, summary = _run(airflow, cluster, tmp_path / "flipped")
        assert run.result["state"] == "failed", run.output[-8000:]
        assert set(summary["checks"]) == set(CHECKS)
        assert summary["replicas"]["ledgers"] == 6 and summary["replicas"]["ranges"] == 6
        assert summary["replicas"]["nodesWithoutLedgers"] == []
        counts = {name: r["violations"] for name, r in summary["checks"].items()}
        assert counts == {**dict.fromkeys(CHECKS, 0), "crc": 1, "replicas": 1}
        [row] = pq.read_table(summary["checks"]["replicas"]["table"]).to_pylist()
        assert (row["node_id"], row["ledger_id"], row["entry_id"], row["kind"]) == (
            FLIP_NODE,
            closed33,
            FLIPPED,
            "crc_mismatch",
        )
        for node in cluster.node_ids:  # the DAG posted it to every node all the same
            stored = w.get_json(f"{cluster.url(node)}/api/v1/audit/result")
            assert stored["summary"] == summary
    finally:
        cluster.close()
