"""A DAG run without a Variable it needs fails at once, saying what to set: its first task
fails without its retries (3, with backoff from 30 s: the better part of an hour during which
the DAG's one active run blocks every new one), and the rest of the run does not start."""

from __future__ import annotations

import pytest

from tests.airflow.conftest import Airflow

NOWHERE = {"kind": "static", "urls": ["http://127.0.0.1:9"]}  # never called


@pytest.mark.parametrize(
    ("dag_id", "variables", "first", "missing"),
    [
        (
            "storage_node_autorecovery",
            {"storage_node_discovery": NOWHERE},
            "live_nodes",
            "storage_node_metadata",
        ),
        ("storage_node_audit", {}, "discover_nodes", "storage_node_discovery"),
    ],
)
def test_a_missing_variable_fails_the_run_at_once_saying_what_to_set(
    airflow: Airflow, dag_id: str, variables: dict[str, object], first: str, missing: str
) -> None:
    run = airflow.run("retrying", dag_id, variables=variables)

    assert run.result["state"] == "failed", run.output[-4000:]
    tasks = {t["taskId"]: t for t in run.result["tasks"]}
    assert tasks[first]["state"] == "failed" and tasks[first]["tryNumber"] == 1, tasks[first]
    assert all(t["state"] in ("upstream_failed", "None") for n, t in tasks.items() if n != first)
    assert f"Variable {missing} is not set" in run.output, run.output[-4000:]
    assert f"AIRFLOW_VAR_{missing.upper()}" in run.output and "make cluster" in run.output
