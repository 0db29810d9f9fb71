"""``make cluster``'s supervisor (node/devcluster.py): one node or etcd stopped and started
again through ``make cluster-node``'s program while the cluster runs, and etcd's death said
at once rather than left silent."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from node.devcluster import STATE_FILE
from tests.harness.hostdisk import REPO, neutral_env

START_TIMEOUT_S = 90.0  # etcd and a node start; only stops a hang
SAID_TIMEOUT_S = 15.0  # the supervisor looks every second
ORDER_TIMEOUT_S = 120.0


class Supervisor:
    """``python -m node.devcluster --nodes 1`` under ``root``, its output read as it comes."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "node.devcluster", "--root", str(root), "--nodes", "1"],
            cwd=REPO,
            env=neutral_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.said: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.wait_said("Ctrl-C stops them all", START_TIMEOUT_S)
        self.state = json.loads((root / STATE_FILE).read_text())

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)

    def wait_said(self, text: str, timeout_s: float) -> str:
        """The first line from now on that holds ``text``."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"never said {text!r}:\n{''.join(self.said)}") from None
            self.said.append(line)
            if text in line:
                return line

    def order(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "node.devcluster", "--root", str(self.root), "node", *args],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=ORDER_TIMEOUT_S,
            check=False,
        )

    def etcd_pid(self) -> int:
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text()
        for pid in children.split():
            if Path(f"/proc/{pid}/comm").read_text().strip() == "etcd":
                return int(pid)
        raise AssertionError(f"no etcd among {children}")

    def interrupt(self) -> int:
        self.proc.send_signal(signal.SIGINT)
        code = self.proc.wait(START_TIMEOUT_S)
        self.reader.join(START_TIMEOUT_S)  # the pipe's end reached
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        return code


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
