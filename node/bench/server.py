"""What ``bench http`` and ``bench stream`` share: the node they start (``python -m node
serve`` on a free loopback port), its CPU time, the load process they drive it with, and
the figures of a run over HTTP."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from node.bench.common import MB, P50, P99, quantile_ms
from node.settings import KiB

ENTRY_SIZE = 1 * KiB  # every entry over HTTP
BATCH_ENTRIES = 100  # entries per batch request
FILL_BATCH = 1000  # entries per add filling a stream or ledger for a read bench
WARMUP_S = 1.0  # the load process's warm-up before its measured window
READY_TIMEOUT_S = 30.0
START_ATTEMPTS = 3  # starts of a node that exited before it was ready (its port taken)
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
INDEX_BYTES = 8  # an entry index in a read bench's payload
STDERR_CHARS = 2000  # of a failed load process's stderr, in the error


def call(url: str, method: str = "GET", body: bytes | None = None, content_type: str = "") -> Any:
    """One request; its JSON body (None when empty)."""
    request = urllib.request.Request(url, data=body, method=method)
    if content_type:
        request.add_header("Content-Type", content_type)
    with urllib.request.urlopen(request, timeout=60) as r:
        return json.loads(r.read() or b"null")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime


def short_machine_line(scratch: Path) -> str:
    """The line on where it ran as these two benchmarks print it: common.machine_line
    without the file system and the event loop."""
    return f"- scratch: {scratch}; python {sys.version.split()[0]}; {os.cpu_count()} CPUs"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A node serving ``data_dir`` on a free loopback port, ready when constructed."""

    def __init__(self, data_dir: Path, env: dict[str, str] | None = None) -> None:
        # A node that exits before it is ready most likely lost its port to another process
        # between free_port() and its bind (a shared machine's tests pick from the same
        # range): it is started again on another port.
        for _attempt in range(START_ATTEMPTS):
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "node", "--log-level", "warning", "serve",
                 "--data-dir", str(data_dir), "--port", str(self.port)],
                env={**os.environ, **(env or {})},
            )  # fmt: skip
            deadline = time.monotonic() + READY_TIMEOUT_S
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    urllib.request.urlopen(f"{self.url}/api/v1/bookie/is_ready", timeout=1).close()
                    return
                except OSError:
                    time.sleep(0.05)
            if self.proc.poll() is None:  # running, never ready: not a port taken
                break
        self.proc.kill()
        raise SystemExit("bench: the node did not start")

    def ledgers(self, count: int) -> list[int]:
        return [call(f"{self.url}/api/v1/ledgers", "POST")["ledgerId"] for _ in range(count)]

    def load(self, module: str, *argv: object) -> tuple[dict[str, Any], float]:
        """``run_load`` against this node: the load's figures and the node's CPU seconds
        charged to the measured window."""
        return run_load([self.proc.pid], self.url, module, *argv)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)


def run_load(pids: list[int], url: str, module: str, *argv: object) -> tuple[dict[str, Any], float]:
    """Runs ``python -m module URL ARGV...``, a load process that warms up for WARMUP_S,
    measures and prints its figures as JSON. Returns them, and the CPU seconds processes
    ``pids`` (the nodes serving it) used, charged to the measured window (their share of the
    CPU used during the whole run)."""
    result, by_pid = run_load_by_pid(pids, url, module, *argv)
    return result, sum(by_pid.values())


def run_load_by_pid(
    pids: list[int], url: str, module: str, *argv: object
) -> tuple[dict[str, Any], dict[int, float]]:
    """``run_load`` with each process's CPU seconds apart (the owner's against the others')."""
    cpu_before = cpu_by_pid(pids)
    result = load_process(module, url, *argv)
    cpu_after = cpu_by_pid(pids)
    share = result["seconds"] / (result["seconds"] + WARMUP_S)
    return result, {pid: (cpu_after[pid] - cpu_before[pid]) * share for pid in pids}


def load_process(module: str, *argv: object) -> dict[str, Any]:
    """Runs ``python -m module ARGV...`` to its end: the figures it prints as JSON
    (LoadFailed with the end of its stderr if it fails)."""
    done = subprocess.run(
        [sys.executable, "-m", module, *map(str, argv)], capture_output=True, text=True
    )
    if done.returncode != 0:
        raise LoadFailed(f"{module} exited {done.returncode}: {done.stderr[-STDERR_CHARS:]}")
    result: dict[str, Any] = json.loads(done.stdout)
    return result


class LoadFailed(RuntimeError):
    """A load process that did not finish its run."""


def cpu_by_pid(pids: list[int]) -> dict[int, float]:
    return {pid: cpu_seconds(pid) for pid in pids}


def indexed_payload(index: int, size: int = ENTRY_SIZE) -> bytes:
    """The payload of the ``index``-th entry a read bench writes: its index over and over, so
    that a read that returns another entry, a shifted or a cut one, compares unequal."""
    stamp = index.to_bytes(INDEX_BYTES, "big")
    return (stamp * (size // INDEX_BYTES + 1))[:size]


def misread(first: int, payloads: Iterable[bytes], size: int = ENTRY_SIZE) -> int:
    """How many of ``payloads``, read in order from entry ``first`` of what a read bench
    wrote (entries of ``size``), are not the entry that belongs there."""
    return sum(p != indexed_payload(first + n, size) for n, p in enumerate(payloads))


@contextlib.contextmanager
def serving(data_dir: Path, env: dict[str, str] | None = None) -> Iterator[Server]:
    """A ``Server`` (``env``: its settings, NODE_...), stopped at the end."""
    server = Server(data_dir, env)
    try:
        yield server
    finally:
        server.stop()


@dataclass(slots=True)
class Figures:
    """One run over HTTP (or of the engine in-process): requests and entries completed in
    ``seconds``, their latencies, and the server's CPU time charged to them."""

    name: str
    requests: int
    entries: int
    seconds: float
    latencies: list[float] = field(repr=False)
    server_cpu_s: float = 0.0

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0

    @property
    def entries_per_s(self) -> float:
        return self.entries / self.seconds if self.seconds else 0.0

    @property
    def mb_per_s(self) -> float:
        return self.entries_per_s * ENTRY_SIZE / MB

    @property
    def cores(self) -> str:
        """The server's CPU time over the run's, "-" without one."""
        if not (self.server_cpu_s and self.seconds):
            return "-"
        return f"{self.server_cpu_s / self.seconds:.2f}"

    def latency_ms(self, quantile: float) -> float:
        return quantile_ms(self.latencies, quantile)

    def cells(self) -> tuple[str, ...]:
        """A table row's first cells: run, requests/s, entries/s, MB/s, p50 and p99 ms."""
        return (
            self.name,
            f"{self.requests_per_s:,.0f}",
            f"{self.entries_per_s:,.0f}",
            f"{self.mb_per_s:,.1f}",
            f"{self.latency_ms(P50):.2f}",
            f"{self.latency_ms(P99):.2f}",
        )
