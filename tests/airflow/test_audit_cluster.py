"""The audit DAG on a real Spark standalone cluster (tests/harness/spark.py) whose worker, and
so every executor, runs as another Unix user that cannot read any node's data directory: the
executors read the snapshots from the nodes over HTTP, with the nodes' admin token (which no
log or output shows), find a byte flipped in one node's copy of an entry (the crc and
replicas checks, on that node only; every other check and replica clean), and the summary
reaches every node. The application runs on the cluster's master, the one spark-submit was
given (the job once set local[*] over it, silently)."""

from __future__ import annotations

import os
import secrets
import subprocess
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from node.audit import CHECKS, snapshot
from node.localcluster import LocalCluster
from tests.airflow.conftest import REPO, Airflow
from tests.airflow.test_audit_replicas import ENTRIES, FLIP_NODE, FLIPPED, _flip
from tests.airflow.test_runs import run_audit
from tests.audit import world as w
from tests.harness.cluster import cluster_env
from tests.harness.spark import NOBODY_UID, StandaloneCluster, running_cluster

TOKEN = f"audit-cluster-{secrets.token_hex(8)}"  # unique: found in a log only if leaked
CONNECTION = {"conn_type": "http", "host": "127.0.0.1", "password": TOKEN}
RUN_TIMEOUT_S = 900.0  # two JVMs, a driver and executors on a busy two-core machine
APP_PREFIX = "storage-node-audit-"  # the DAG's spark-submit --name
UNAUTHORIZED = 401
# The executors' user cannot run the venv's interpreter (it lives under root's home): the
# system's CPython of the same version, with the venv's packages and this checkout on its path.
SYSTEM_PYTHON = "/usr/bin/python3"


@pytest.fixture(scope="module")
def spark_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandaloneCluster]:
    with running_cluster(tmp_path_factory.mktemp("spark"), worker_uid=NOBODY_UID) as running:
        yield running


def _readable_by_worker(path: Path) -> bool:
    probe = ["setpriv", f"--reuid={NOBODY_UID}", f"--regid={NOBODY_UID}", "--clear-groups"]
    return subprocess.run([*probe, "test", "-r", str(path)], check=False).returncode == 0


@pytest.mark.timeout(1200)
def test_the_audit_dag_on_a_spark_cluster_reads_the_nodes_over_http(
    airflow: Airflow, spark_cluster: StandaloneCluster, tmp_path: Path
) -> None:
    env = cluster_env({"NODE_ADMIN_TOKEN": TOKEN})
    cluster = LocalCluster(tmp_path / "cluster", nodes=3, env=env)
    try:
        closed33, _closed22 = w.write_ledgers(
            cluster, [(3, 3, 2, True), (3, 2, 2, True)], ENTRIES, token=TOKEN
        )
        flip_url = cluster.url(FLIP_NODE)
        taken = w.post_json(f"{flip_url}/api/v1/audit/snapshot", {}, token=TOKEN)
        held = snapshot.fetch(taken["uri"])
        _flip(held, closed33, FLIPPED)
        # The executors' user cannot read a node's logs: only the node can serve them, and
        # only with the token.
        logs = sorted((held / "logs").glob("*.log"))
        assert logs and not _readable_by_worker(logs[0])
        assert w.status_of(f"{taken['url']}logs/{logs[0].name}") == UNAUTHORIZED

        urls = sorted(cluster.url(n) for n in cluster.node_ids)
        out_dir = tmp_path / "out"
        spark = {"conn_type": "spark", "host": spark_cluster.url}
        run = run_audit(
            airflow,
            urls,
            out_dir,
            CONNECTION,
            spark,
            RUN_TIMEOUT_S,
            python=SYSTEM_PYTHON,
            python_path=f"{REPO}{os.pathsep}{sysconfig.get_paths()['purelib']}",
        )
        assert run.result["state"] == "failed", run.output[-8000:]
        states = {(t["taskId"], t["mapIndex"]): t["state"] for t in run.result["tasks"]}
        assert {s for (task, _), s in states.items() if task == "snapshot"} == {"success"}
        assert f"Spark master: {spark_cluster.url}" in run.output, run.output[-8000:]
        apps = [a for a in spark_cluster.applications() if a["name"].startswith(APP_PREFIX)]
        assert len(apps) == 1 and apps[0]["state"] == "FINISHED", spark_cluster.state()
        summaries = list(out_dir.glob("*/summary.json"))
        assert len(summaries) == 1, run.output[-12000:]
        [summary_file] = summaries
        summary = w.read_json(summary_file)
        counts = {name: r["violations"] for name, r in summary["checks"].items()}
        assert counts == {**dict.fromkeys(CHECKS, 0), "crc": 1, "replicas": 1}, summary
        assert summary["replicas"]["ledgers"] == 6 and summary["replicas"]["ranges"] == 6
        [crc] = pq.read_table(summary["checks"]["crc"]["table"]).to_pylist()
        assert (crc["ledger_id"], crc["entry_id"]) == (closed33, FLIPPED)
        assert crc["node"] == w.read_json(held / "snapshot.json")["node"]
        [row] = pq.read_table(summary["checks"]["replicas"]["table"]).to_pylist()
        assert (row["node_id"], row["entry_id"], row["kind"]) == (
            FLIP_NODE,
            FLIPPED,
            "crc_mismatch",
        )
        for node in cluster.node_ids:  # posted to every node all the same
            stored = w.get_json(f"{cluster.url(node)}/api/v1/audit/result", token=TOKEN)
            assert stored["summary"] == summary
        # The token is in no log and no output: Airflow's, the job's, Spark's own and the
        # executors' (Airflow masks it in what it logs; nothing masks what Spark writes).
        secret = TOKEN.encode()
        assert secret not in run.output.encode()
        written = {p: p.read_bytes() for p in out_dir.rglob("*") if p.is_file()}
        written.update(spark_cluster.every_log())
        leaked = [path for path, data in written.items() if secret in data]
        assert not leaked, leaked
    finally:
        cluster.close()
