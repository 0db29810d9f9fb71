"""``make cluster``'s supervisor (node/devcluster.py): one node or etcd stopped and started
again through ``make cluster-node``'s program while the cluster runs, and etcd's death said
at once rather than left silent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from node.devcluster import STATE_FILE
from tests.harness.devcluster import ORDER_TIMEOUT_S, Supervisor
from tests.harness.hostdisk import REPO

SAID_TIMEOUT_S = 15.0  # the supervisor looks every second


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/heartbeat", timeout=2):
            return True
    except (urllib.error.URLError, OSError):
        return False


@pytest.fixture
def supervisor(tmp_path: Path) -> Iterator[Supervisor]:
    running = Supervisor(tmp_path / "cluster")
    yield running
    if running.proc.poll() is None:
        running.interrupt()


def test_one_node_is_stopped_and_started_again_on_its_port(supervisor: Supervisor) -> None:
    url = supervisor.state["nodes"]["n0"]
    assert _answers(url)

    stopped = supervisor.order("n0", "stop")

    assert stopped.returncode == 0 and "node n0 stopped" in stopped.stdout, stopped
    assert not _answers(url)
    started = supervisor.order("n0")  # start, as `make cluster-node ID=n0`
    assert started.returncode == 0 and f"node n0 started: {url}" in started.stdout, started
    assert _answers(url)
    again = supervisor.order("n0", "start")
    assert again.returncode == 1 and "node n0 is running" in again.stderr, again
    unknown = supervisor.order("n7", "stop")
    assert unknown.returncode == 1 and "no node 'n7'" in unknown.stderr, unknown
    # An ordered stop is not reported as an exit; a SIGKILL from outside is.
    assert not [line for line in supervisor.said if "exited" in line], supervisor.said


def test_etcd_dying_is_said_and_it_is_started_again(supervisor: Supervisor) -> None:
    os.kill(supervisor.etcd_pid(), signal.SIGKILL)

    line = supervisor.wait_said("etcd exited with -9", SAID_TIMEOUT_S)
    assert "make cluster-node ID=etcd" in line and "etcd.log" in line, line
    started = supervisor.order("etcd")
    assert started.returncode == 0, started
    assert supervisor.state["metadataUrl"] in started.stdout, started
    assert supervisor.interrupt() == 0
    assert not (supervisor.root / STATE_FILE).exists()


def test_no_cluster_running_is_said(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "node.devcluster", "--root", str(tmp_path), "node", "n1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=ORDER_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 1 and "no `make cluster` is running" in done.stderr, done
