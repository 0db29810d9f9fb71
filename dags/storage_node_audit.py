"""Daily audit of every node's data with Spark (node/audit/job.py): each node writes a snapshot
consistent with one checkpoint (POST /api/v1/audit/snapshot, answering its URI), one
spark-submit audits all the snapshots together, and the summary is posted back to every node
(POST /api/v1/audit/result), which keeps it and exports it as metrics. A node with a metadata
store puts its fleet id and the replicated ledgers' metadata (read just before) into its
snapshot, so the same job also runs the fleet-wide replicas check over all of them: every node
of an entry's write set holds the entry, with the same CRC32C.

Spark runs through the connection spark_default: local[*] unless the connection names a
cluster (spark://..., k8s://...), which the job then runs on. With the param readSnapshots
"http" (the default), the job is given each snapshot's URL on its node: the executors read the
tables and byte ranges of the logs from the nodes over HTTP (the admin token, the password of
the connection storage_node, reaches them through NODE_ADMIN_TOKEN), so they need no access to
the nodes' volumes; "file" gives the job the snapshot's directory (executors beside the data).
spark-submit is run by bare name from the worker's PATH; the job's driver and its
executors run the interpreter of the param python, which must import the node package and its
dependencies (pyarrow, rocksdict): the node's venv, or any with the node installed. When the
node is a source checkout rather than installed, the param pythonPath names its root.

The job's driver runs in the Airflow worker (client mode) and writes <outDir>/<run id>/:
summary.json and the violation tables, which this DAG reads back. The job exits 1 when it
finds violations: the summary is still posted, then the run fails, so a violation alerts like
any failed DAG."""

from __future__ import annotations

import json
import logging
from datetime import datetime
from pathlib import Path
from typing import Any

from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator
from airflow.sdk import Param, dag, get_current_context, task
from storage_node_common import (
    DEFAULT_ARGS,
    DISCOVERY_VARIABLE,
    TAGS,
    NodeError,
    discover,
    required_variable,
)

log = logging.getLogger(__name__)


@dag(
    dag_id="storage_node_audit",
    schedule="@daily",
    start_date=datetime(2025, 1, 1),
    catchup=False,
    max_active_runs=1,
    default_args=DEFAULT_ARGS,
    tags=[*TAGS, "audit", "spark"],
    params={
        "application": Param(
            "/opt/storage-node/node/audit/job.py", type="string", description="spark-submit's"
        ),
        "outDir": Param("/tmp/storage-node-audit", type="string"),
        "python": Param(
            "/opt/storage-node/bin/python",
            type="string",
            description="the driver's and executors' interpreter: one that imports node",
        ),
        "pythonPath": Param(
            "", type="string", description="PYTHONPATH of the job: a source checkout's root"
        ),
        "readSnapshots": Param(
            "http",
            enum=["http", "file"],
            description="http: the executors read the snapshots from the nodes (a cluster); "
            "file: from the snapshot directories (executors beside the nodes' volumes)",
        ),
    },
    doc_md=__doc__,
)
def storage_node_audit() -> None:
    @task
    def discover_nodes() -> list[str]:
        return discover(required_variable(DISCOVERY_VARIABLE, deserialize_json=True))

    @task(map_index_template="{{ url }}")
    def snapshot(url: str) -> str:
        from storage_node_common import node_client

        reply = node_client(url).call("POST", "/api/v1/audit/snapshot", {})
        over_http = get_current_context()["params"]["readSnapshots"] == "http"
        uri = str(reply["url"] if over_http and reply.get("url") else reply["uri"])
        log.info("node %s: snapshot at %s", url, uri)
        return uri

    @task
    def audit_arguments(uris: list[str]) -> list[str]:
        context = get_current_context()
        out = Path(context["params"]["outDir"]) / context["run_id"]
        args = []
        for uri in uris:
            args += ["--snapshot", uri]
        return [*args, "--out", str(out)]

    @task(trigger_rule="all_done", map_index_template="{{ url }}")
    def post_result(url: str) -> dict[str, Any]:
        """Runs after the audit whatever its exit status: violations (exit 1) are results to
        store on the nodes. No summary at all means the audit could not run: that fails."""
        from storage_node_common import node_client

        context = get_current_context()
        summary_path = Path(context["params"]["outDir"]) / context["run_id"] / "summary.json"
        if not summary_path.is_file():
            raise RuntimeError(f"the audit wrote no {summary_path}: see the audit task's log")
        summary: dict[str, Any] = json.loads(summary_path.read_text())
        node_client(url).call("POST", "/api/v1/audit/result", summary)
        # summary.json: {"status": "clean" | "violations", "checks": {name: {"violations"}}}
        violations = {name: r["violations"] for name, r in summary["checks"].items()}
        log.info("node %s: audit result posted; violations %s", url, violations)
        if summary["status"] != "clean":
            raise NodeError(f"node {url}: the audit found violations: {violations}")
        return {"node": url, "violations": violations}

    urls = discover_nodes()
    uris = snapshot.expand(url=urls)
    audit = SparkSubmitOperator(
        task_id="audit",
        conn_id="spark_default",
        application="{{ params.application }}",
        application_args=audit_arguments(uris),
        name="storage-node-audit-{{ ds_nodash }}",
        conf={
            "spark.ui.enabled": "false",
            "spark.ui.showConsoleProgress": "false",
            # Not spark-submit's own Python (the Airflow worker's): the node's.
            "spark.pyspark.python": "{{ params.python }}",
            "spark.pyspark.driver.python": "{{ params.python }}",
        },
        env_vars={
            "PYTHONPATH": "{{ params.pythonPath }}",
            # The nodes' snapshot routes want the admin token: the driver hands it to the
            # executors (Airflow masks it in the rendered fields, Spark in its UI).
            "NODE_ADMIN_TOKEN": "{{ conn.storage_node.password or '' }}",
        },
    )
    audit >> post_result.expand(url=urls)


storage_node_audit()
