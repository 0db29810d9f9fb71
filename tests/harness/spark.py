"""A real Spark standalone cluster on loopback for the tests: the master and one worker that
ship in the pyspark package (``spark-class org.apache.spark.deploy.master.Master`` and
``...deploy.worker.Worker``), on free ports, stopped after. The worker, and so every executor
it starts, may run as another Unix user (``nobody``): one that cannot read the nodes' data
directories (pytest's temporary directories are the owner's alone), as on Kubernetes, where
the executors' pods do not mount the nodes' volumes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.harness.ports import free_port

HOST = "127.0.0.1"
START_TIMEOUT_S = 90.0  # two JVMs on a busy two-core machine
POLL_S = 0.2
STOP_TIMEOUT_S = 20.0
NOBODY_UID = 65534  # Debian's nobody/nogroup: no access to root's 0700 directories
WORKER_CORES = 2
WORKER_MEMORY = "1g"
# The tests' JVMs (master, worker, spark-submit's driver, executors, tests/audit's session)
# live for minutes at most and run small jobs: C2's compiling was much of their CPU (the
# cluster audit's spark-submit and its executor: 83 CPU-s, 39 with C1 alone and the serial
# collector; tests/audit/test_audit.py: 129 CPU-s, 89).
QUICK_JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
VENV_BIN = Path(sys.executable).parent


class SparkUnavailable(RuntimeError):
    """Java or Spark cannot start here: the message says what to install."""


def spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).parent


def quick_jvm_env() -> dict[str, str]:
    """What makes every JVM started with this environment, and its children, start quick
    (the worker's executors inherit the worker's)."""
    return {"JAVA_TOOL_OPTIONS": QUICK_JVM_OPTIONS}


def spark_env(**extra: str) -> dict[str, str]:
    """The environment of spark-class and spark-submit: the venv's bin first on PATH (its
    python for the Python workers), Spark on loopback, SPARK_HOME the pyspark package."""
    return {
        **os.environ,
        "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}",
        "SPARK_HOME": str(spark_home()),
        "SPARK_LOCAL_IP": HOST,
        "PYSPARK_PYTHON": sys.executable,
        **quick_jvm_env(),
        **extra,
    }


class StandaloneCluster:
    def __init__(self, work_dir: Path, worker_uid: int | None = None) -> None:
        self.work_dir = work_dir
        self.worker_uid = worker_uid
        self.port = free_port()
        self.webui_port = free_port()
        self.url = f"spark://{HOST}:{self.port}"
        self._procs: list[subprocess.Popen[bytes]] = []
        self._worker_root: Path | None = None

    # --- the master's JSON view ------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"http://{HOST}:{self.webui_port}/json", timeout=5) as r:
            return dict(json.load(r))

    def applications(self) -> list[dict[str, Any]]:
        """Every application the master has seen, running or finished."""
        state = self.state()
        return [*state.get("activeapps", []), *state.get("completedapps", [])]

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        if shutil.which("java") is None:
            raise SparkUnavailable("no java on PATH: `make tools` installs a Java runtime")
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self._spawn(
            "master",
            [
                "org.apache.spark.deploy.master.Master",
                "--host",
                HOST,
                "--port",
                str(self.port),
                "--webui-port",
                str(self.webui_port),
            ],
        )
        self._wait("the master's web UI", lambda s: s.get("status") == "ALIVE")
        # The worker's own directories outside the test's (which stay the owner's alone).
        own = Path(tempfile.mkdtemp(prefix="spark-worker-"))
        self._worker_root = own
        worker_dir, scratch = own / "work", own / "tmp"
        for path in (worker_dir, scratch):
            path.mkdir()
        if self.worker_uid is not None:
            for path in (own, worker_dir, scratch):
                os.chown(path, self.worker_uid, self.worker_uid)
        self._spawn(
            "worker",
            [
                "org.apache.spark.deploy.worker.Worker",
                self.url,
                "--host",
                HOST,
                "--port",
                str(free_port()),
                "--webui-port",
                str(free_port()),
                "--cores",
                str(WORKER_CORES),
                "--memory",
                WORKER_MEMORY,
                "--work-dir",
                str(worker_dir),
            ],
            uid=self.worker_uid,
            drop_env=("PYTHONPATH",),  # the executors import what the job says, nothing of ours
            extra_env={
                "SPARK_LOCAL_DIRS": str(scratch),
                "TMPDIR": str(scratch),
                "HOME": str(scratch),
                "PYTHONDONTWRITEBYTECODE": "1",
            },
        )
        self._wait(
            "a worker registered on the master",
            lambda s: any(w.get("state") == "ALIVE" for w in s.get("workers", [])),
        )

    def _spawn(
        self,
        name: str,
        args: list[str],
        uid: int | None = None,
        extra_env: dict[str, str] | None = None,
        drop_env: tuple[str, ...] = (),
    ) -> None:
        log = (self.work_dir / f"{name}.log").open("wb")
        command = [str(spark_home() / "bin" / "spark-class"), *args]
        if uid is not None:
            command = [
                "setpriv",
                f"--reuid={uid}",
                f"--regid={uid}",
                "--clear-groups",
                *command,
            ]
        proc = subprocess.Popen(
            command,
            env={k: v for k, v in spark_env(**(extra_env or {})).items() if k not in drop_env},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its JVM's children go with it on stop
        )
        log.close()
        self._procs.append(proc)

    def _wait(self, what: str, ready: Any) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            for proc in self._procs:
                if proc.poll() is not None:
                    raise SparkUnavailable(
                        f"Spark exited ({proc.returncode}) before {what}:\n{self.logs()}"
                    )
            try:
                if ready(self.state()):
                    return
            except (urllib.error.URLError, OSError, ValueError):
                pass
            time.sleep(POLL_S)
        raise SparkUnavailable(f"no {what} after {START_TIMEOUT_S} s:\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted(self.work_dir.glob("*.log"))
        )

    def every_log(self) -> dict[Path, bytes]:
        """The master's and the worker's logs and every file the worker's executors left
        (their stdout and stderr), while the cluster runs: what a secret must not be in."""
        roots = [self.work_dir, *([self._worker_root] if self._worker_root else [])]
        return {p: p.read_bytes() for root in roots for p in root.rglob("*") if p.is_file()}

    def stop(self) -> None:
        for proc in reversed(self._procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in reversed(self._procs):
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self._procs.clear()
        if self._worker_root is not None:
            shutil.rmtree(self._worker_root, ignore_errors=True)


@contextmanager
def running_cluster(work_dir: Path, worker_uid: int | None = None) -> Iterator[StandaloneCluster]:
    cluster = StandaloneCluster(work_dir, worker_uid)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
