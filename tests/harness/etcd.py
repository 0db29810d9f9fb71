"""A real single-member etcd on free loopback ports (client and peer) in a temp dir: the metadata
store of the client tests. A test may pause it (SIGSTOP: connections are accepted, nothing
answers), kill it and start it again on the same ports and data."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.harness.ports import free_port

READY_TIMEOUT_S = 30.0
READY_POLL_S = 0.05


def etcd_binary() -> str:
    """etcd's path; a test that needs it fails (never skips) when it is not installed."""
    path = shutil.which("etcd")
    if path is None:
        pytest.fail("etcd is not on PATH: run `make tools` (installs Debian's etcd-server)")
    return path


class EtcdServer:
    def __init__(self, work_dir: Path) -> None:
        self.work_dir = work_dir
        self.data_dir = work_dir / "etcd-data"
        self.log_path = work_dir / "etcd.log"
        self.client_port = free_port()
        self.peer_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def client_url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    def url(self, prefix: str) -> str:
        """The store URL of ``prefix`` on this server (NODE_METADATA_URL's form)."""
        return f"etcd://127.0.0.1:{self.client_port}/{prefix}"

    def start(self) -> None:
        peer = f"http://127.0.0.1:{self.peer_port}"
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    etcd_binary(),
                    "--name",
                    "test",
                    "--data-dir",
                    str(self.data_dir),
                    "--listen-client-urls",
                    self.client_url,
                    "--advertise-client-urls",
                    self.client_url,
                    "--listen-peer-urls",
                    peer,
                    "--initial-advertise-peer-urls",
                    peer,
                    "--initial-cluster",
                    f"test={peer}",
                    "--logger",
                    "zap",
                    "--log-level",
                    "warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.wait_healthy()

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"etcd exited with {self.proc.returncode}: {self.log_path.read_text()[-2000:]}"
                )
            try:
                with urllib.request.urlopen(self.client_url + "/health", timeout=1) as resp:
                    if b'"true"' in resp.read():
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(READY_POLL_S)
        raise RuntimeError(
            f"etcd not healthy in {READY_TIMEOUT_S} s: {self.log_path.read_text()[-2000:]}"
        )

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL: what it had not fsynced is lost, as on a crash."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def restart(self) -> None:
        self.kill()
        self.start()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGCONT)  # a paused etcd cannot act on SIGTERM
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None


@contextmanager
def running_etcd(work_dir: Path) -> Iterator[EtcdServer]:
    server = EtcdServer(work_dir)
    server.start()
    try:
        yield server
    finally:
        server.stop()
