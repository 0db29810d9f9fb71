"""The DAG files import cleanly in Airflow and declare what the fleet relies on (their runs
against live nodes are in test_runs.py)."""

from __future__ import annotations

from tests.airflow.conftest import Airflow

EXPECTED = {
    "storage_node_retention": ("@hourly", {"retention"}),
    "storage_node_compaction": ("@hourly", {"compaction"}),
    "storage_node_offload": ("@hourly", {"offload"}),
    "storage_node_audit": ("@daily", {"audit", "spark"}),
    "storage_node_autorecovery": ("*/10 * * * *", {"autorecovery", "replication"}),
}


def test_dags_import_with_their_schedules_tags_and_retries(airflow: Airflow) -> None:
    bag = airflow.run("dagbag").result
    assert bag["importErrors"] == {}
    dags = bag["dags"]
    assert set(dags) == set(EXPECTED)
    for dag_id, (schedule, tags) in EXPECTED.items():
        dag = dags[dag_id]
        assert dag["schedule"] == schedule, dag_id
        assert set(dag["tags"]) == {"storage-node", *tags}, dag_id
        # Every task, the Spark one included: bounded retries, backoff, a timeout.
        assert set(dag["retries"].values()) == {3}, dag_id
        assert all(dag["backoff"].values()), dag_id
        assert set(dag["timeouts"].values()) == {"0:30:00"}, dag_id
        if dag_id != "storage_node_autorecovery":  # it needs one live node: live_nodes
            assert "discover_nodes" in dag["tasks"], dag_id
        assert dag["maxActiveRuns"] == 1, dag_id
    assert dags["storage_node_audit"]["tasks"] == [
        "audit",
        "audit_arguments",
        "discover_nodes",
        "post_result",
        "snapshot",
    ]
    assert dags["storage_node_compaction"]["tasks"] == [
        "compaction_kind",
        "discover_nodes",
        "run_compaction",
    ]
    recovery = dags["storage_node_autorecovery"]
    assert recovery["params"] == {
        "lost_node_recovery_delay_s": 600,
        "decommission": "",
        "replicas_check_interval_h": 24,
    }
    assert recovery["tasks"] == ["audit", "decommission", "live_nodes", "rereplicate"]
    # The audit sees the decommission's mark; one re-replication per marker the audit found.
    assert recovery["upstream"] == {
        "live_nodes": [],
        "decommission": ["live_nodes"],
        "audit": ["decommission", "live_nodes"],
        "rereplicate": ["audit", "live_nodes"],
    }
    assert recovery["perRun"]["rereplicate"] == 4
