"""Runs Airflow for the DAG tests, inside .venv-airflow (Airflow's pins clash with the node's,
so the tests drive it through this script in a subprocess; the nodes run from the node's venv).

    python runner.py migrate                 create the metadata DB in $AIRFLOW_HOME
    python runner.py dagbag                  the DAGs' ids, schedules, tags, retries, errors
    python runner.py test DAG_ID [CONF]      dag.test() with retries off; JSON of the run
    python runner.py retrying DAG_ID [CONF]  the same with the retries the DAG declares, at
                                             once (no delay): a task's tries are counted
    python runner.py discover CONFIG         storage_node_common.discover(CONFIG)
    python runner.py serve                   the commands above, one per line of stdin

Results are printed as one line "RESULT <json>" (Airflow logs around it go to stdout too).

``serve`` keeps one process for a session's runs: Airflow's imports and its in-process
execution API (FastAPI routes for every API version) cost some seven seconds of CPU, which a
process per run paid every time. Each stdin line is a JSON object: ``args`` (a command as
above), ``env`` (the whole environment of the run: its Variables and Connections) and
``output`` (a file that gets the run's stdout and stderr, as a process per run would print
them). When the command is over, ``DONE <exit status>`` goes to the original stdout."""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

DAGS = Path(__file__).resolve().parents[2] / "dags"
MARK = "RESULT "


def emit(value: Any) -> None:
    print(MARK + json.dumps(value, default=str), flush=True)


def dagbag(dag_id: str | None = None) -> Any:
    """All the DAGs, or the one of ``dag_id`` alone (its file is named after it: parsing the
    others costs every run a second of CPU)."""
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(DAGS if dag_id is None else DAGS / f"{dag_id}.py"))


def describe() -> None:
    bag = dagbag()
    dags = {}
    for dag_id, dag in bag.dags.items():
        dags[dag_id] = {
            "schedule": str(dag.schedule),
            "tags": sorted(dag.tags),
            "retries": {t.task_id: t.retries for t in dag.tasks},
            "timeouts": {t.task_id: str(t.execution_timeout) for t in dag.tasks},
            "backoff": {t.task_id: t.retry_exponential_backoff for t in dag.tasks},
            "tasks": sorted(t.task_id for t in dag.tasks),
            "maxActiveRuns": dag.max_active_runs,
            "params": dag.params.dump(),
            "upstream": {t.task_id: sorted(t.upstream_task_ids) for t in dag.tasks},
            "perRun": {t.task_id: t.max_active_tis_per_dagrun for t in dag.tasks},
        }
    emit({"importErrors": dict(bag.import_errors), "dags": dags})


def run_test(dag_id: str, conf: dict[str, Any], retrying: bool = False) -> None:
    from datetime import timedelta

    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    dag = dagbag(dag_id).get_dag(dag_id)
    assert dag is not None, f"no DAG {dag_id} in {DAGS / f'{dag_id}.py'}"
    # Retries would make dag.test() wait out the backoff of a task failing on purpose (a node
    # that is down); the import test checks the retries the DAGs really declare.
    for t in dag.tasks:
        if retrying:
            t.retry_delay = timedelta(0)
            t.retry_exponential_backoff = False
        else:
            t.retries = 0
    dr = dag.test(run_conf=conf or None)
    tasks = []
    with create_session() as session:
        for ti in dr.get_task_instances(session=session):
            rows = (
                session.query(XComModel)
                .filter_by(
                    dag_id=dag_id,
                    run_id=dr.run_id,
                    task_id=ti.task_id,
                    map_index=ti.map_index,
                    key="return_value",
                )
                .all()
            )
            tasks.append(
                {
                    "taskId": ti.task_id,
                    "mapIndex": ti.map_index,
                    "state": str(ti.state),
                    "tryNumber": ti.try_number,
                    "xcom": XComModel.deserialize_value(rows[0]) if rows else None,
                }
            )
    tasks.sort(key=lambda t: (t["taskId"], t["mapIndex"]))
    emit({"state": str(dr.state), "tasks": tasks})


def serve() -> None:
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    for line in sys.stdin:
        request = json.loads(line)
        os.environ.clear()
        os.environ.update(request["env"])
        status = 0
        with open(request["output"], "w") as output:
            sys.stdout.flush()
            sys.stderr.flush()
            saved = os.dup(1), os.dup(2)
            os.dup2(output.fileno(), 1)
            os.dup2(output.fileno(), 2)
            try:
                dispatch(request["args"])
            except SystemExit as e:
                status = e.code if isinstance(e.code, int) else 1
            except BaseException:
                traceback.print_exc()
                status = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
                os.close(saved[0])
                os.close(saved[1])
        replies.write(f"DONE {status}\n")


def main() -> None:
    # Airflow's DAG processor and workers put the dags folder on sys.path (the DAG files import
    # storage_node_common from it); this process parses the DAGs itself, so it does the same.
    sys.path.insert(0, str(DAGS))
    if sys.argv[1] == "serve":
        serve()
    else:
        dispatch(sys.argv[1:])


def dispatch(args: list[str]) -> None:
    command = args[0]
    if command == "migrate":
        from airflow.utils.db import resetdb

        resetdb()
        emit({"home": os.environ["AIRFLOW_HOME"]})
    elif command == "dagbag":
        describe()
    elif command in ("test", "retrying"):
        conf = json.loads(args[2]) if len(args) > 2 else {}
        run_test(args[1], conf, retrying=command == "retrying")
    elif command == "discover":
        from storage_node_common import discover

        emit(discover(json.loads(args[1])))
    else:
        raise SystemExit(f"unknown command {command!r}")


if __name__ == "__main__":
    main()
