"""The audit job on a real Spark standalone cluster (a master and a worker on loopback,
tests/harness/spark.py): spark-submit's ``--master`` is the master the job runs on (it once
set local[*] over it, silently)."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from node.audit import job
from tests.audit import world as w
from tests.harness.spark import StandaloneCluster, running_cluster, spark_env

pytestmark = pytest.mark.timeout(600)

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
SUBMIT_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandaloneCluster]:
    with running_cluster(tmp_path_factory.mktemp("spark")) as running:
        yield running


def spark_submit(master: str, name: str, args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            str(VENV_BIN / "spark-submit"),
            "--master",
            master,
            "--name",
            name,
            "--conf",
            "spark.ui.enabled=false",
            str(REPO / "node" / "audit" / "job.py"),
            *args,
        ],
        env=spark_env(PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=SUBMIT_TIMEOUT_S,
        check=False,
    )


def test_spark_submit_master_is_the_one_the_job_runs_on(
    cluster: StandaloneCluster, tmp_path: Path
) -> None:
    world = w.build(tmp_path / "data")
    w.flip_payload_byte(world, world.plain[0], 1)
    name = f"audit-{uuid.uuid4().hex[:8]}"
    out = tmp_path / "out"
    result = spark_submit(
        cluster.url,
        name,
        ["--data-dir", str(world.data_dir), "--out", str(out), "--checks", "crc,index"],
    )
    assert result.returncode == job.EXIT_VIOLATIONS, result.stderr[-3000:]
    registered = [app["name"] for app in cluster.applications()]
    assert name in registered, f"the master saw {registered}, not the audit"
    assert f"Spark master: {cluster.url}" in result.stdout.splitlines()
    summary = w.read_json(out / job.SUMMARY_FILE)
    assert summary["checks"]["crc"]["violations"] == 1
