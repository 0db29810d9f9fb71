"""Hourly stream retention on every node: POST /api/v1/retention/run, one mapped task per node.

The node's own retention scheduler can be turned off (retention_scheduler_enabled=false) when
this DAG drives it. A rerun does no harm: retention deletes only what is out of retention.

With a metadata store (replicated streams), each node's run acts on the streams it owns, after
taking over those no live node owns: visiting every node reaches every stream, once."""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from airflow.sdk import Variable, dag, task
from storage_node_common import DEFAULT_ARGS, DISCOVERY_VARIABLE, TAGS, NodeError, discover

log = logging.getLogger(__name__)


@dag(
    dag_id="storage_node_retention",
    schedule="@hourly",
    start_date=datetime(2025, 1, 1),
    catchup=False,
    max_active_runs=1,
    default_args=DEFAULT_ARGS,
    tags=[*TAGS, "retention"],
    doc_md=__doc__,
)
def storage_node_retention() -> None:
    @task
    def discover_nodes() -> list[str]:
        return discover(Variable.get(DISCOVERY_VARIABLE, deserialize_json=True))

    @task(map_index_template="{{ url }}")
    def run_retention(url: str) -> dict[str, Any]:
        from storage_node_common import node_client

        node = node_client(url)
        state = node.state()  # unreachable: fails here, naming the node
        result = node.call("POST", "/api/v1/retention/run")
        deleted = {
            stream: [d["ledgerId"] for d in deletions]
            for stream, deletions in result["streams"].items()
        }
        freed = sum(d["bytes"] for ds in result["streams"].values() for d in ds)
        log.info("node %s: deleted %s (%d bytes)", url, deleted or "nothing", freed)
        if state.get("readOnly"):
            # Retention ran (deleting is what a full node needs), but the node must be looked
            # at: the task fails rather than letting a read-only node pass unnoticed.
            raise NodeError(f"node {url} is read-only (retention ran and deleted {deleted})")
        return {"node": url, "deletedLedgers": deleted, "bytes": freed}

    run_retention.expand(url=discover_nodes())


storage_node_retention()
