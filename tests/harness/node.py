"""The node as a real process on loopback (crash, shutdown and end-to-end tests), and the
fixture that reaps it."""

from __future__ import annotations

import json
import resource
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from node.settings import Settings
from tests.harness.hostdisk import neutral_env
from tests.harness.ports import free_port

READY_TIMEOUT_S = 30.0

# Settings that make checkpoints, journal rotations and entry log rolls frequent, so that
# a random kill often lands inside one of them.
CHURN_SETTINGS = {
    "NODE_FLUSH_INTERVAL_MS": "100",
    "NODE_JOURNAL_MAX_SIZE": str(256 * 1024),
    "NODE_JOURNAL_PRE_ALLOC_SIZE": str(128 * 1024),
    "NODE_LOG_SIZE_LIMIT": str(1024 * 1024),
    "NODE_DB_STORAGE_WRITE_CACHE_MAX_SIZE": str(2 * 1024 * 1024),
    "NODE_MAX_ENTRY_SIZE": str(256 * 1024),
}
# The node's own defaults for the settings above: NodeProcess(env=DEFAULT_SETTINGS) runs a
# node as shipped (host-disk-neutral still), since what matters must pass with defaults too.
DEFAULT_SETTINGS = {
    key: str(Settings.model_fields[key.removeprefix("NODE_").lower()].default)
    for key in CHURN_SETTINGS
}


class NodeProcess:
    started: list[NodeProcess] = []  # killed by reap_nodes after each test, pass or fail

    def __init__(
        self,
        data_dir: Path,
        env: dict[str, str] | None = None,
        open_files: tuple[int, int] | None = None,
    ) -> None:
        self.data_dir = data_dir
        self.open_files = open_files  # RLIMIT_NOFILE (soft, hard) of the process, as systemd sets
        self.port = free_port()
        self.env = {**neutral_env(), **CHURN_SETTINGS}
        self.env.pop("NODE_CRASH_POINTS", None)
        self.env.update(env or {})
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = data_dir.parent / f"node-{data_dir.name}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 (lives as long as the process)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "node",
                "serve",
                "--data-dir",
                str(self.data_dir),
                "--port",
                str(self.port),
            ],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=self._limit if self.open_files else None,
        )
        NodeProcess.started.append(self)
        log.close()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"node exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(f"{self.url}/api/v1/ledgers", timeout=1):
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.05)
        raise AssertionError(f"node did not answer within {READY_TIMEOUT_S} s:\n{self.log()}")

    def _limit(self) -> None:
        """In the child, before exec."""
        assert self.open_files is not None
        resource.setrlimit(resource.RLIMIT_NOFILE, self.open_files)

    def kill(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def terminate(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGQUIT)  # every thread's stack, into the log
            time.sleep(1)
            self.kill()
            raise AssertionError(
                f"node did not stop within {timeout} s of SIGTERM; its log ends:\n{self.log()}"
            ) from None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-5000:]
        except FileNotFoundError:
            return ""

    def get_json(self, path: str) -> Any:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=10) as r:
            return json.loads(r.read())

    def get_bytes(self, path: str) -> bytes:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=30) as r:
            return bytes(r.read())


@pytest.fixture(autouse=True)
def reap_nodes() -> Iterator[None]:
    """No node process a test starts outlives it, whatever the test's outcome. Autouse for the
    whole suite (tests/conftest.py imports it); a node started by a module-scoped fixture,
    before the test, is that fixture's to stop."""
    before = len(NodeProcess.started)
    yield
    while len(NodeProcess.started) > before:
        NodeProcess.started.pop().kill()
