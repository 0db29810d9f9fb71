"""A real Prometheus (Debian's package: `make tools` installs it) as a subprocess on a free
loopback port with temporary storage, scraping given targets every second. Never the Debian
service, never port 9090: the tests must not depend on, or disturb, a Prometheus of the host."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from tests.harness.ports import free_port

READY_TIMEOUT_S = 30.0
JOB = "storage-node"  # as the alert rules' `up{job=~"storage-node.*"}` expects


class Prometheus:
    def __init__(self, work_dir: Path, targets: list[str], rule_files: list[Path]) -> None:
        binary = shutil.which("prometheus")
        assert binary, "prometheus is not installed: make tools"
        self.binary = binary
        self.work_dir = work_dir
        self.port = free_port()
        self.config = work_dir / "prometheus.yml"
        self.config.write_text(
            yaml.safe_dump(
                {
                    "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                    "rule_files": [str(p) for p in rule_files],
                    "scrape_configs": [{"job_name": JOB, "static_configs": [{"targets": targets}]}],
                }
            )
        )
        self.log_path = work_dir / "prometheus.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115 (lives as long as the process)
        self.proc = subprocess.Popen(
            [
                self.binary,
                f"--config.file={self.config}",
                f"--storage.tsdb.path={self.work_dir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited:\n{self.log()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1):
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.1)
        raise AssertionError(f"prometheus not ready in {READY_TIMEOUT_S} s:\n{self.log()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def api(self, path: str, **params: str) -> Any:
        """GET /api/v1/<path>; a 400 (a query that does not parse) comes back as its body."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=30) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            return json.loads(e.read())

    def query(self, expr: str) -> Any:
        return self.api("query", query=expr, time=str(time.time()))

    def wait_for(self, expr: str, timeout_s: float = 30.0) -> list[Any]:
        """Poll until ``expr`` returns a series; its result."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            answer = self.query(expr)
            assert answer["status"] == "success", (expr, answer)
            if answer["data"]["result"]:
                return list(answer["data"]["result"])
            time.sleep(0.25)
        raise AssertionError(f"no data for {expr} within {timeout_s} s:\n{self.log()}")
