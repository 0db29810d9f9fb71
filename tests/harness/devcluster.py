"""``make cluster``'s program (``python -m node.devcluster``) run by a test: its output read
as it comes, its orders (``make cluster-node``'s) sent, and Ctrl-C."""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from node.devcluster import STATE_FILE
from tests.harness.hostdisk import REPO, neutral_env

START_TIMEOUT_S = 90.0  # etcd and the nodes start; only stops a hang
ORDER_TIMEOUT_S = 120.0


class Supervisor:
    """``python -m node.devcluster --nodes NODES`` under ``root``, up (``state``: its
    devcluster.json), its output read as it comes."""

    def __init__(self, root: Path, nodes: int = 1) -> None:
        self.root = root
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "node.devcluster", "--root", str(root), "--nodes", str(nodes)],
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
