"""Autorecovery of replicated ledgers every 10 minutes: a live node audits the fleet's metadata
store (POST /api/v1/autorecovery/audit), which writes an under-replicated marker for each
ledger with a fragment on a node lost longer than ``lost_node_recovery_delay_s``, on a
decommissioning node, or on a replica short of entries; then one mapped task per marker asks a
node to re-replicate that ledger (POST /api/v1/autorecovery/rereplicate): it locks the marker
under a lease, copies the fragments to replacements (or, onto a short replica, the entries it
lacks), CAS-replaces the nodes in the ledger's segments and deletes the marker.

Every run's audit runs the ledger check (``checkLedgers``): each replica of each settled
fragment says, from its index, which ids it lacks; no entry is read. A writer that closed its
ledger at Qa before a slow replica's add failed leaves such a replica short, and the same run
copies the entries onto it. Once every ``replicas_check_interval_h`` hours (0: every run; the
last time is in the audit report the nodes keep, so a missed run delays it, never skips it)
the audit runs the replicas check instead (``checkReplicas``): every entry read from every
replica and the CRC32C compared, which also finds a replica holding other bytes.

The work runs in the nodes, through their own client of the store: Airflow needs no etcd
access. Every call carries the Airflow Variable ``storage_node_metadata`` (the store's URL,
e.g. ``etcd://etcd:2379/storage``) as ``metadataUrl``; a node of another fleet refuses it
(409 metadata_mismatch), so a DAG pointed at one fleet never acts through another's node.
The ``decommission`` param (a node id) marks that node decommissioning first: its ledgers are
re-replicated away, and ``python -m node shell decommission NODE --wait`` says when it holds
nothing needed.

A rerun does no harm: a marker whose ledger was re-replicated is gone ("gone"), one another
worker holds answers "locked", and an open ledger's last fragment still in its grace period
answers "waiting": those outcomes are logged and left to the next run, never a failure. The
re-replications are spread over the live nodes (each ledger on its own node, the next one if
that node does not answer), so no node sits idle while another copies everything."""

from __future__ import annotations

import logging
import time
import urllib.error
from datetime import datetime
from typing import Any

from airflow.sdk import Param, Variable, dag, get_current_context, task
from storage_node_common import (
    DEFAULT_ARGS,
    DISCOVERY_VARIABLE,
    METADATA_VARIABLE,
    REQUEST_TIMEOUT_S,
    TAGS,
    NodeError,
    admin_token,
    discover,
    required_variable,
)

log = logging.getLogger(__name__)

# Outcomes of a re-replication that leave the marker to the next run: not failures.
LATER = {"locked": "another worker holds its lock", "waiting": "an open ledger in its grace"}
FINISHED = {"done", "gone"}
# Re-replications of one run at once: each copies whole fragments between nodes; more would
# compete with the clients' traffic. The markers' leases keep two workers off one ledger.
PARALLEL_COPIES = 4
HOUR_MS = 3600 * 1000
# The audit call that reads every entry of the fleet: minutes on a large one, within the
# task's execution timeout (storage_node_common.DEFAULT_ARGS).
REPLICAS_CHECK_TIMEOUT_S = 25 * 60


def replicas_check_due(last_ms: int, interval_h: int, now_ms: int) -> bool:
    """Whether this run's audit reads every entry: none was ever read (0), or the last full
    check is ``interval_h`` hours old (0: every run)."""
    return interval_h == 0 or last_ms == 0 or now_ms - last_ms >= interval_h * HOUR_MS


def _reachable(error: NodeError) -> bool:
    """Whether the node answered (an HTTP error) rather than being unreachable."""
    return isinstance(error.__cause__, urllib.error.HTTPError)


def _live(urls: list[str]) -> list[str]:
    """The nodes that answer and are not shutting down, in discovery order."""
    from storage_node_common import node_client

    live = []
    for url in urls:
        try:
            state = node_client(url).state()
        except NodeError as error:
            log.warning("node %s left out: %s", url, error)
            continue
        if state.get("shuttingDown"):
            log.warning("node %s left out: shutting down", url)
            continue
        live.append(url)
    if not live:
        raise NodeError(f"no live node among {urls}")
    return live


@dag(
    dag_id="storage_node_autorecovery",
    schedule="*/10 * * * *",
    start_date=datetime(2025, 1, 1),
    catchup=False,
    # One run at a time: a second run's audit would race the first run's copies (harmless,
    # the locks hold, but it doubles the load for nothing).
    max_active_runs=1,
    default_args=DEFAULT_ARGS,
    tags=[*TAGS, "autorecovery", "replication"],
    doc_md=__doc__,
    params={
        # BookKeeper's lostBookieRecoveryDelay: a node gone for less is left alone (a restart,
        # a rescheduled pod) rather than copied away.
        "lost_node_recovery_delay_s": Param(600, type="integer", minimum=0),
        # A node id to decommission, or "" for none.
        "decommission": Param("", type="string"),
        # Hours between two replicas checks (every entry read); the runs between them run
        # the ledger check (each replica's index asked). 0: the replicas check every run.
        "replicas_check_interval_h": Param(24, type="integer", minimum=0),
    },
)
def storage_node_autorecovery() -> None:
    @task
    def live_nodes() -> list[str]:
        required_variable(METADATA_VARIABLE)  # the run's first task fails at once without it
        return _live(discover(required_variable(DISCOVERY_VARIABLE, deserialize_json=True)))

    @task
    def decommission(urls: list[str]) -> str | None:
        from storage_node_common import node_client

        node_id = str(get_current_context()["params"]["decommission"]).strip()
        if not node_id:
            return None
        body = {"metadataUrl": Variable.get(METADATA_VARIABLE), "nodeId": node_id}
        node_client(urls[0]).call("POST", "/api/v1/autorecovery/decommission", body)
        log.info("node %s marked decommissioning (through %s)", node_id, urls[0])
        return node_id

    @task
    def audit(urls: list[str]) -> list[int]:
        from storage_node_common import NodeClient, node_client

        params = get_current_context()["params"]
        status = node_client(urls[0]).call("GET", "/api/v1/autorecovery/status")
        last_ms = int((status.get("lastAudit") or {}).get("lastReplicasCheckMs") or 0)
        full = replicas_check_due(
            last_ms, int(params["replicas_check_interval_h"]), int(time.time() * 1000)
        )
        body = {
            "metadataUrl": Variable.get(METADATA_VARIABLE),
            "lostNodeRecoveryDelaySeconds": int(params["lost_node_recovery_delay_s"]),
            "checkLedgers": True,
            "checkReplicas": full,
        }
        timeout_s = REPLICAS_CHECK_TIMEOUT_S if full else REQUEST_TIMEOUT_S
        report: dict[str, Any] = NodeClient(urls[0], admin_token(), timeout_s).call(
            "POST", "/api/v1/autorecovery/audit", body
        )
        markers = [int(ledger) for ledger in report.get("markers", [])]
        log.info(
            "audit through %s (%s): %s under-replicated ledgers, %s fragments, lost nodes %s, "
            "decommissioning %s; %s entries missing on a replica; %d markers",
            urls[0],
            f"replicas check, {report.get('replicasChecked')} entries read"
            if full
            else f"ledger check, {report.get('fragmentsChecked')} fragments asked",
            report.get("underReplicatedLedgers"),
            report.get("underReplicatedFragments"),
            report.get("lostNodes"),
            report.get("decommissioningNodes"),
            report.get("entriesMissing"),
            len(markers),
        )
        return markers

    @task(map_index_template="{{ ledger_id }}", max_active_tis_per_dagrun=PARALLEL_COPIES)
    def rereplicate(ledger_id: int, urls: list[str]) -> dict[str, Any]:
        from storage_node_common import node_client

        body = {"metadataUrl": Variable.get(METADATA_VARIABLE), "ledgerId": ledger_id}
        start = ledger_id % len(urls)
        last: NodeError | None = None
        for url in urls[start:] + urls[:start]:
            try:
                result: dict[str, Any] = node_client(url).call(
                    "POST", "/api/v1/autorecovery/rereplicate", body
                )
            except NodeError as error:
                if _reachable(error):
                    raise  # the node answered with an error: the task's retries try again
                log.warning("ledger %d: %s; trying the next node", ledger_id, error)
                last = error
                continue
            outcome = result.get("outcome")
            if outcome in LATER:
                log.warning(
                    "ledger %d not re-replicated by %s: %s (%s); the next run tries again",
                    ledger_id,
                    url,
                    outcome,
                    LATER[outcome],
                )
            elif outcome in FINISHED:
                log.info(
                    "ledger %d %s by %s: %s fragments, %s entries, %s bytes",
                    ledger_id,
                    outcome,
                    url,
                    result.get("fragments"),
                    result.get("entries"),
                    result.get("bytes"),
                )
            else:
                raise NodeError(f"node {url}: ledger {ledger_id}: unknown outcome {result}")
            return {"node": url, **result}
        raise NodeError(f"ledger {ledger_id}: no node answered (last: {last})")

    urls = live_nodes()
    markers = audit(urls)
    decommission(urls) >> markers
    rereplicate.partial(urls=urls).expand(ledger_id=markers)


storage_node_autorecovery()
