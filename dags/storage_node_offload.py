"""Hourly offload of closed stream ledgers to the object store on every node:
POST /api/v1/offload/run with {} (every stream by its policies), one mapped task per node.

Idempotent: a ledger offloaded already is skipped by the node, and so is one deleted before or
during its offload (reason "deleted"): skips never fail a task. A node that reports failed
ledgers (an upload that failed, or the object store failing: offload_store_error,
offload_store_unavailable, offload_store_timeout in the error) fails its task (its offloaded
ledgers stay offloaded; the task's retries and the next run retry the rest), and so does a
node that refused the run ("refused": its local store shares a data disk above the warning
watermark, where offloading would fill the disk).

With a metadata store (replicated streams), each node's run offloads the streams it owns, after
taking over those no live node owns: visiting every node reaches every stream, once."""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from airflow.sdk import Variable, dag, task
from storage_node_common import DEFAULT_ARGS, DISCOVERY_VARIABLE, TAGS, NodeError, discover

log = logging.getLogger(__name__)


@dag(
    dag_id="storage_node_offload",
    schedule="@hourly",
    start_date=datetime(2025, 1, 1),
    catchup=False,
    max_active_runs=1,
    default_args=DEFAULT_ARGS,
    tags=[*TAGS, "offload"],
    doc_md=__doc__,
)
def storage_node_offload() -> None:
    @task
    def discover_nodes() -> list[str]:
        return discover(Variable.get(DISCOVERY_VARIABLE, deserialize_json=True))

    @task(map_index_template="{{ url }}")
    def run_offload(url: str) -> dict[str, Any]:
        from storage_node_common import node_client

        node = node_client(url)
        node.require_writable()
        result: dict[str, Any] = node.call("POST", "/api/v1/offload/run", {})
        log.info(
            "node %s: offloaded %s, local copies deleted %s, skipped %d, failed %s",
            url,
            result.get("offloaded"),
            result.get("localDeleted"),
            len(result.get("skipped", [])),
            result.get("failed"),
        )
        if result.get("failed"):
            raise NodeError(f"node {url}: offload failed for {result['failed']}")
        if result.get("refused"):
            raise NodeError(f"node {url}: offload refused: {result['refused']}")
        return {"node": url, **result}

    run_offload.expand(url=discover_nodes())


storage_node_offload()
