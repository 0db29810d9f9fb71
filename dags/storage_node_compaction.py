"""Compaction on every node: minor every hour, major once a day (the run whose logical hour is
midnight UTC), or what the "kind" param says when triggered by hand. PUT /api/v1/bookie/gc with
forceMinor/forceMajor, then gc_details is polled until the run is over, within a timeout.
Bytes reclaimed per node come from the node's storage_node_gc_reclaimed_bytes_total counter.

Idempotent: a second forced GC finds nothing more to reclaim and does no harm. A read-only
node is compacted too (a full disk is when it matters; the node's GC copies only what fits the
free space), and then its task fails, naming it, as retention's does."""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from airflow.sdk import Param, Variable, dag, get_current_context, task
from storage_node_common import DEFAULT_ARGS, DISCOVERY_VARIABLE, TAGS, NodeError, discover

log = logging.getLogger(__name__)

GC_TIMEOUT_S = 25 * 60  # under the task's execution timeout (30 min): our error, not a kill


@dag(
    dag_id="storage_node_compaction",
    schedule="@hourly",
    start_date=datetime(2025, 1, 1),
    catchup=False,
    max_active_runs=1,
    default_args=DEFAULT_ARGS,
    tags=[*TAGS, "compaction"],
    params={
        "kind": Param("auto", enum=["auto", "minor", "major"], description="auto: major at 00h"),
        "timeoutSeconds": Param(GC_TIMEOUT_S, type="integer", minimum=1),
    },
    doc_md=__doc__,
)
def storage_node_compaction() -> None:
    @task
    def discover_nodes() -> list[str]:
        return discover(Variable.get(DISCOVERY_VARIABLE, deserialize_json=True))

    @task
    def compaction_kind() -> str:
        context = get_current_context()
        kind = str(context["params"]["kind"])
        if kind == "auto":
            logical = context.get("logical_date") or context["dag_run"].run_after
            kind = "major" if logical.hour == 0 else "minor"
        log.info("this run forces a %s compaction", kind)
        return kind

    @task(map_index_template="{{ url }}")
    def run_compaction(url: str, kind: str) -> dict[str, Any]:
        from storage_node_common import node_client, wait_for_gc

        context = get_current_context()
        node = node_client(url)
        state = node.state()  # unreachable: fails here, naming the node
        if state.get("shuttingDown"):
            raise NodeError(f"node {url} is shutting down: {state}")
        before, reclaimed_before = node.gc_details(), node.reclaimed_bytes()
        major = kind == "major"
        node.call("PUT", "/api/v1/bookie/gc", {"forceMajor": major, "forceMinor": not major})
        after = wait_for_gc(node, float(context["params"]["timeoutSeconds"]))
        reclaimed_after = node.reclaimed_bytes()
        reclaimed = {
            by: int(reclaimed_after.get(by, 0) - reclaimed_before.get(by, 0))
            for by in ("deletion", "compaction")
        }
        counters = {
            key: after[key] - before[key]
            for key in (
                "majorCompactionCounter",
                "minorCompactionCounter",
                "spaceCompactionCounter",
            )
        }
        result = {
            "node": url,
            "kind": kind,
            "reclaimedBytes": reclaimed,
            "compactions": counters,
            "spaceAmplification": after["spaceAmplification"],
            "lastErrors": after["lastErrors"],
            "unreadableLogs": after["unreadableLogs"],
        }
        log.info("node %s: %s compaction done: %s", url, kind, result)
        if after["unreadableLogs"]:
            log.warning("node %s: unreadable entry logs %s", url, after["unreadableLogs"])
        if state.get("readOnly"):
            # Compaction ran: a full node needs it most, and its GC copies only what fits the
            # free space. The task still fails, so that a read-only node does not pass unseen.
            raise NodeError(f"node {url} is read-only (compaction ran: {result})")
        return result

    run_compaction.partial(kind=compaction_kind()).expand(url=discover_nodes())


storage_node_compaction()
