"""Airflow runs in its own venv (.venv-airflow, `make .venv-airflow`): its pins clash with the
node's. The tests drive it through runner.py in a subprocess (one per session, which runs the
commands one after the other), sharing one AIRFLOW_HOME (and SQLite DB, migrated once) per
session; the nodes under test run from this venv."""

from __future__ import annotations

import json
import os
import select
import subprocess
import time
from collections.abc import Iterator
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
        self._runner: subprocess.Popen[bytes] | None = None  # runner.py serve, started once
        self._runs = 0

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
        self._runs += 1
        output_path = self.home / f"run-{self._runs}.log"
        request = {
            "args": list(args),
            "env": self.env(variables or {}, connections or {}),
            "output": str(output_path),
        }
        runner = self._serving()
        assert runner.stdin is not None
        runner.stdin.write(json.dumps(request).encode() + b"\n")
        runner.stdin.flush()
        status = self._done(runner, timeout_s or RUN_TIMEOUT_S)
        output = output_path.read_text() if output_path.exists() else ""
        if status is None:
            self.close()  # a run that hung or killed the runner: the next run starts a new one
        results = [line for line in output.splitlines() if line.startswith("RESULT ")]
        assert status == 0 and results, f"runner {args} failed ({status=}):\n{output[-8000:]}"
        return Run(json.loads(results[-1].removeprefix("RESULT ")), output)

    def _serving(self) -> subprocess.Popen[bytes]:
        if self._runner is None or self._runner.poll() is not None:
            with (self.home / "runner.log").open("ab") as log:  # between runs: the rare stray line
                self._runner = subprocess.Popen(
                    [str(AIRFLOW_VENV / "bin" / "python"), str(RUNNER), "serve"],
                    env=self.env({}, {}),
                    cwd=self.home,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=log,
                )
        return self._runner

    @staticmethod
    def _done(runner: subprocess.Popen[bytes], timeout_s: float) -> int | None:
        """The exit status of the run in progress, from its ``DONE`` line; None if the runner
        died or the run took longer than ``timeout_s``."""
        assert runner.stdout is not None
        fd = runner.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        pending = b""
        while True:
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if line.startswith(b"DONE "):
                    return int(line.removeprefix(b"DONE "))
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            pending += chunk

    def close(self) -> None:
        if self._runner is not None:
            self._runner.kill()
            self._runner.communicate()  # reaps it and closes its pipes
            self._runner = None


@pytest.fixture(scope="session")
def airflow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Airflow]:
    python = AIRFLOW_VENV / "bin" / "python"
    assert python.exists(), f"no {python}: `make .venv-airflow` installs Airflow there"
    instance = Airflow(tmp_path_factory.mktemp("airflow-home"))
    try:
        instance.run("migrate")
        yield instance
    finally:
        instance.close()
