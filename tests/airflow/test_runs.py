"""dag.test() runs of the DAGs against live nodes (NodeProcess, from the node's venv), checking
what the nodes report afterwards. The nodes require an admin token: it reaches the tasks only
through the Airflow connection storage_node."""

from __future__ import annotations

import json
import re
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from tests.airflow.conftest import REPO, Airflow, Run
from tests.harness.hostdisk import as_env
from tests.harness.moto import new_bucket, s3_client, s3_settings
from tests.harness.node import NodeProcess

TOKEN = "airflow-test-token"
CONNECTION = {"conn_type": "http", "host": "127.0.0.1", "password": TOKEN}
# Local Spark: spark-submit from PATH (conftest puts the Airflow venv's bin first).
SPARK = {"conn_type": "spark", "host": "local[2]"}


def call(node: NodeProcess, method: str, path: str, body: Any = None, raw: bytes = b"") -> Any:
    data = raw or (json.dumps(body).encode() if body is not None else None)
    request = urllib.request.Request(f"{node.url}{path}", data=data, method=method)
    request.add_header("Authorization", f"Bearer {TOKEN}")
    if raw:
        request.add_header("Content-Type", "application/octet-stream")
    elif data is not None:
        request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=30) as reply:
        text = reply.read()
    return json.loads(text) if text else None


def start_nodes(tmp_path: Path, count: int, **env: str) -> list[NodeProcess]:
    nodes = [
        NodeProcess(tmp_path / f"n{i}", {"NODE_ADMIN_TOKEN": TOKEN, **env}) for i in range(count)
    ]
    for node in nodes:
        node.start()
    return nodes


def rolling_stream(node: NodeProcess, entries: int, **policies: int) -> list[int]:
    """A stream whose every entry lands in a ledger of its own; the ledger ids."""
    call(
        node,
        "PUT",
        "/api/v1/streams/orders",
        {"maxEntriesPerLedger": 1, "minLedgerRolloverTimeMinutes": 0, **policies},
    )
    for i in range(entries):
        call(node, "POST", "/api/v1/streams/orders/entries", raw=bytes([i]) * 1000)
    return [x["ledgerId"] for x in call(node, "GET", "/api/v1/streams/orders")["ledgers"]]


def run_dag(airflow: Airflow, dag_id: str, urls: list[str], conf: dict[str, Any] | None = None):  # type: ignore[no-untyped-def]
    run = airflow.run(
        "test",
        dag_id,
        json.dumps(conf or {}),
        variables={"storage_node_discovery": {"kind": "static", "urls": urls}},
        connections={"storage_node": CONNECTION},
    )
    return run


def mapped(run_result: dict[str, Any], task_id: str) -> dict[int, dict[str, Any]]:
    return {t["mapIndex"]: t for t in run_result["tasks"] if t["taskId"] == task_id}


def test_retention_on_two_nodes_and_one_down(airflow: Airflow, tmp_path: Path) -> None:
    a, b, down = start_nodes(tmp_path, 3)
    # Retention time 0 and no cursor: every closed ledger is out of retention.
    ledgers = {node.url: rolling_stream(node, 3, retentionTimeInMinutes=0) for node in (a, b)}
    down.kill()  # a node that was in the fleet and died
    time.sleep(0.05)
    urls = sorted([a.url, b.url, down.url])  # discovery sorts: map index i is urls[i]

    run = run_dag(airflow, "storage_node_retention", urls)
    assert run.result["state"] == "failed"
    tasks = mapped(run.result, "run_retention")
    assert {i: t["state"] for i, t in tasks.items()} == {
        i: "failed" if url == down.url else "success" for i, url in enumerate(urls)
    }
    # The failure names the node that is down.
    assert f"node {down.url} is unreachable" in run.output
    for node in (a, b):
        result = tasks[urls.index(node.url)]["xcom"]
        assert result["node"] == node.url
        # All three: the run also rolls the last ledger, full at one entry, and deletes it.
        assert result["deletedLedgers"] == {"orders": ledgers[node.url]}
        assert result["bytes"] == 3 * 1000
        stream = call(node, "GET", "/api/v1/streams/orders")
        assert stream["entries"] == 0
        assert not set(ledgers[node.url]) & {x["ledgerId"] for x in stream["ledgers"]}


def test_major_compaction_on_three_nodes_reclaims_space(airflow: Airflow, tmp_path: Path) -> None:
    """The third node is read-only: it is compacted as well, and its task fails naming it."""
    nodes = start_nodes(tmp_path, 3)
    before = {}
    for node in nodes:
        # Six ledgers written round-robin, so that each 1 MiB entry log holds all six; four
        # deleted: every sealed log is a third live, below the major threshold (0.8).
        lids = [call(node, "POST", "/api/v1/ledgers")["ledgerId"] for _ in range(6)]
        for i in range(60):
            for lid in lids:
                call(node, "POST", f"/api/v1/ledgers/{lid}/entries", raw=bytes([i]) * 8000)
        for lid in lids[:4]:
            call(node, "DELETE", f"/api/v1/ledgers/{lid}")
        before[node.url] = call(node, "GET", "/api/v1/bookie/gc_details")[0]
    read_only = nodes[2]
    call(read_only, "PUT", "/api/v1/bookie/state/readonly", {"readOnly": True})
    urls = sorted(n.url for n in nodes)

    run = run_dag(airflow, "storage_node_compaction", urls, {"kind": "major"})
    assert run.result["state"] == "failed", run.output[-5000:]
    tasks = mapped(run.result, "run_compaction")
    assert {i: t["state"] for i, t in tasks.items()} == {
        i: "failed" if url == read_only.url else "success" for i, url in enumerate(urls)
    }
    failure = re.search(
        rf"node {re.escape(read_only.url)} is read-only \(compaction ran: (.*)\)", run.output
    )
    assert failure, run.output[-5000:]
    reclaimed = re.search(r"'reclaimedBytes': \{'deletion': \d+, 'compaction': (\d+)\}", failure[1])
    assert reclaimed and int(reclaimed[1]) > 0, failure[1]
    for node in nodes:
        after = call(node, "GET", "/api/v1/bookie/gc_details")[0]
        moved = after["majorCompactionCounter"] - before[node.url]["majorCompactionCounter"]
        assert moved >= 1
        assert after["forceCompacting"] is False
        if node is read_only:
            continue
        result = tasks[urls.index(node.url)]["xcom"]
        assert result["kind"] == "major"
        assert result["compactions"]["majorCompactionCounter"] == moved
        assert result["reclaimedBytes"]["compaction"] > 0, result


def test_offload_on_two_nodes(airflow: Airflow, tmp_path: Path, moto_endpoint: str) -> None:
    """Both nodes offload to one bucket of moto's S3 server, each under its own prefix."""
    bucket = new_bucket(moto_endpoint)
    nodes = []
    for i in range(2):
        s3 = {**s3_settings(moto_endpoint, bucket), "offload_prefix": f"node-{i}"}
        node = NodeProcess(tmp_path / f"n{i}", {"NODE_ADMIN_TOKEN": TOKEN, **as_env(s3)})
        node.start()
        nodes.append(node)
    ledgers = {}
    for node in nodes:
        # offloadThresholdInBytes 0: every closed ledger goes to the store.
        ledgers[node.url] = rolling_stream(node, 3, offloadThresholdInBytes=0)
    urls = sorted(ledgers)

    run = run_dag(airflow, "storage_node_offload", urls)
    assert run.result["state"] == "success", run.output[-5000:]
    tasks = mapped(run.result, "run_offload")
    for node in nodes:
        result = tasks[urls.index(node.url)]["xcom"]
        closed = ledgers[node.url][:-1]
        assert result["offloaded"] == closed and result["failed"] == [], result
        for lid in closed:
            assert call(node, "GET", f"/api/v1/ledgers/{lid}")["offload"]["state"] == "offloaded"
    s3 = s3_client(moto_endpoint)
    for i, node in enumerate(nodes):
        listed = s3.list_objects_v2(Bucket=bucket, Prefix=f"node-{i}/").get("Contents", [])
        keys = {o["Key"] for o in listed}
        for lid in ledgers[node.url][:-1]:  # a data and an index object per offloaded ledger
            assert any(k.startswith(f"node-{i}/{lid}/") for k in keys), (lid, sorted(keys))


def project_python() -> str:
    """The interpreter that imports node (pyarrow, rocksdict, pyspark): the repository's venv
    when `make test` made one, else the one running the tests (not the Airflow venv's)."""
    venv = REPO / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def run_audit(
    airflow: Airflow,
    urls: list[str],
    out_dir: Path,
    connection: dict[str, Any],
    spark: dict[str, Any] = SPARK,
    timeout_s: float | None = None,
    python: str | None = None,
    python_path: str | None = None,
) -> Run:
    """A dag.test() run of the audit DAG over ``urls``, the job writing under ``out_dir``."""
    conf = {
        "application": str(REPO / "node" / "audit" / "job.py"),
        "outDir": str(out_dir),
        "python": python or project_python(),
        "pythonPath": python_path or str(REPO),
    }
    return airflow.run(
        "test",
        "storage_node_audit",
        json.dumps(conf),
        variables={"storage_node_discovery": {"kind": "static", "urls": urls}},
        connections={"storage_node": connection, "spark_default": spark},
        timeout_s=timeout_s,
    )


def test_audit_on_two_nodes_stores_the_result_on_each(airflow: Airflow, tmp_path: Path) -> None:
    """Snapshots, one spark-submit over both (local Spark, spark-submit from the Airflow
    venv's PATH, the job's Python the node's), and the summary posted back to each node."""
    nodes = start_nodes(tmp_path, 2)
    ledgers = {node.url: rolling_stream(node, 3) for node in nodes}
    urls = sorted(ledgers)
    out_dir = tmp_path / "audit-out"
    run = run_audit(airflow, urls, out_dir, CONNECTION)
    assert run.result["state"] == "success", run.output[-8000:]
    states = {(t["taskId"], t["mapIndex"]): t["state"] for t in run.result["tasks"]}
    assert set(states.values()) == {"success"}, states
    # Each node's snapshot is its own, served by the node, and the job read both.
    uris = mapped(run.result, "snapshot")
    for i, node in enumerate(sorted(nodes, key=lambda n: n.url)):
        assert uris[i]["xcom"].startswith(f"{node.url}/api/v1/audit/snapshots/"), uris[i]
    [summary_file] = out_dir.glob("*/summary.json")
    summary = json.loads(summary_file.read_text())
    assert summary["status"] == "clean", summary
    assert len(summary["nodes"]) == 2 and summary["checks"], summary
    posted = mapped(run.result, "post_result")
    for node in nodes:
        assert posted[urls.index(node.url)]["xcom"] == {
            "node": node.url,
            "violations": {name: 0 for name in summary["checks"]},
        }
        # What the node keeps and exports: the very summary the job wrote.
        stored = call(node, "GET", "/api/v1/audit/result")
        assert stored["summary"] == summary
        metrics = node.get_bytes("/metrics").decode()
        [stamp] = re.findall(
            r"^storage_node_audit_last_run_timestamp_seconds (\S+)$", metrics, re.MULTILINE
        )
        assert float(stamp) == summary["finishedMs"] / 1000
