"""Airflow runs in its own venv (.venv-airflow, `make .venv-airflow`): its pins clash with the
node's. The tests drive it through runner.py in subprocesses, sharing one AIRFLOW_HOME (and
SQLite DB, migrated once) per session; the nodes under test run from this venv."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.harness.spark import quick_jvm_env

REPO = Path(__file__).resolve().parents[2]
AIRFLOW_VENV = Path(os.environ.get("AIRFLOW_VENV", REPO / ".venv-airflow"))
RUNNER = Path(__file__).with_name("runner.py")
RUN_TIMEOUT_S = 180.0


@dataclass
class Run:
    result: Any
    output: str  # Airflow's logs: what a task said, including why it failed


class Airflow:
    def __init__(self, home: Path) -> None:
        self.home = home

    def env(self, variables: dict[str, Any], connections: dict[str, Any]) -> dict[str, str]:
        # Nothing of the caller's Airflow setup may leak in (a real AIRFLOW_HOME, a token).
        env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
        env.update(
            AIRFLOW_HOME=str(self.home),
            AIRFLOW__CORE__LOAD_EXAMPLES="False",
            AIRFLOW__CORE__DAGS_FOLDER=str(REPO / "dags"),
            # spark-submit is found by bare name: the Airflow venv's bin first on PATH.
            PATH=f"{AIRFLOW_VENV / 'bin'}:{env.get('PATH', '')}",
            **quick_jvm_env(),  # the audit DAG's spark-submit
        )
        for name, value in variables.items():
            # A string as Airflow stores one (Variable.get returns it as is); others as JSON
            # (Variable.get(..., deserialize_json=True)).
            env[f"AIRFLOW_VAR_{name.upper()}"] = (
                value if isinstance(value, str) else json.dumps(value)
            )
        for name, value in connections.items():
            env[f"AIRFLOW_CONN_{name.upper()}"] = json.dumps(value)
        return env

    def run(
        self,
        *args: str,
        variables: dict[str, Any] | None = None,
        connections: dict[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> Run:
        proc = subprocess.run(
            [str(AIRFLOW_VENV / "bin" / "python"), str(RUNNER), *args],
            env=self.env(variables or {}, connections or {}),
            cwd=self.home,
            capture_output=True,
            text=True,
            timeout=timeout_s or RUN_TIMEOUT_S,
        )
        output = proc.stdout + proc.stderr
        results = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        assert proc.returncode == 0 and results, f"runner {args} failed:\n{output[-8000:]}"
        return Run(json.loads(results[-1].removeprefix("RESULT ")), output)


@pytest.fixture(scope="session")
def airflow(tmp_path_factory: pytest.TempPathFactory) -> Airflow:
    python = AIRFLOW_VENV / "bin" / "python"
    assert python.exists(), f"no {python}: `make .venv-airflow` installs Airflow there"
    instance = Airflow(tmp_path_factory.mktemp("airflow-home"))
    instance.run("migrate")
    return instance
