"""``python -m node bench http``: the live server over loopback, driven by a separate load
process, next to the in-process engine measured in the same run.

Runs, each for ``--seconds`` after a warm-up:
- single adds: POST one 1 KiB entry per request, from ``--connections`` connections;
- batch adds: POST 100 entries of 1 KiB per request (one durable acknowledgment);
- reads: GET one entry per request, spread over a pre-filled ledger;
- the engine in-process: the same single adds and batches without HTTP.

Targets (issue 3): batch ingest over HTTP at least 50% of the in-process engine's entries/s
for the same batches; single adds at least 5,000/s per core of the server process (its CPU
time is read from /proc, so the figure does not depend on how many cores the box has).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node.http.frames import BATCH_CONTENT_TYPE, encode_batch
from node.runtime import run, tune_gc
from node.settings import KiB, load
from node.storage.ledgers import LedgerStorage

ENTRY_SIZE = 1 * KiB
BATCH_ENTRIES = 100
READ_LEDGER_ENTRIES = 20_000  # entries pre-filled for the read run
WARMUP_S = 1.0
READY_TIMEOUT_S = 30.0
MS_PER_S = 1000.0
MB = 1_000_000
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
ENGINE_WINDOW = 64  # adds in flight in-process, as many as the HTTP run's connections


@dataclass(slots=True)
class Figures:
    name: str
    requests: int
    entries: int
    seconds: float
    latencies: list[float]
    server_cpu_s: float = 0.0

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0

    @property
    def entries_per_s(self) -> float:
        return self.entries / self.seconds if self.seconds else 0.0

    def latency_ms(self, quantile: float) -> float:
        if not self.latencies:
            return 0.0
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(quantile * len(ordered)))] * MS_PER_S


# --- the load process ----------------------------------------------------------------------


async def _load(
    url: str, mode: str, connections: int, seconds: float, ledgers: list[int]
) -> dict[str, Any]:
    import aiohttp  # the load process only

    payload = bytes(ENTRY_SIZE)
    batch = encode_batch([payload] * BATCH_ENTRIES)
    latencies: list[float] = []
    counts = {"requests": 0, "entries": 0, "errors": 0}
    state = {"recording": False, "running": True}

    async def worker(n: int, session: aiohttp.ClientSession) -> None:
        rng = random.Random(n)
        ledger = ledgers[n % len(ledgers)]
        while state["running"]:
            started = time.perf_counter()
            if mode == "single":
                request = session.post(
                    f"{url}/api/v1/ledgers/{ledger}/entries",
                    data=payload,
                    headers={"Content-Type": "application/octet-stream"},
                )
                entries = 1
            elif mode == "batch":
                request = session.post(
                    f"{url}/api/v1/ledgers/{ledger}/entries",
                    data=batch,
                    headers={"Content-Type": BATCH_CONTENT_TYPE},
                )
                entries = BATCH_ENTRIES
            else:
                entry = rng.randrange(READ_LEDGER_ENTRIES)
                request = session.get(f"{url}/api/v1/ledgers/{ledgers[0]}/entries/{entry}")
                entries = 1
            async with request as response:
                await response.read()
                ok = response.status < 300
            if state["recording"]:
                if ok:
                    counts["requests"] += 1
                    counts["entries"] += entries
                    latencies.append(time.perf_counter() - started)
                else:
                    counts["errors"] += 1

    connector = aiohttp.TCPConnector(limit=connections)
    async with aiohttp.ClientSession(connector=connector) as session:
        tasks = [asyncio.create_task(worker(n, session)) for n in range(connections)]
        await asyncio.sleep(WARMUP_S)
        state["recording"] = True
        began = time.perf_counter()
        await asyncio.sleep(seconds)
        state["recording"] = False
        elapsed = time.perf_counter() - began
        state["running"] = False
        await asyncio.gather(*tasks)
    return {**counts, "seconds": elapsed, "latencies": latencies}


def load_main(argv: list[str]) -> None:
    url, mode, connections, seconds, ledgers = argv
    result = run(
        _load(url, mode, int(connections), float(seconds), [int(x) for x in ledgers.split(",")])
    )
    json.dump(result, sys.stdout)


# --- the server ------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _call(url: str, method: str = "GET", body: bytes | None = None, content_type: str = "") -> Any:
    request = urllib.request.Request(url, data=body, method=method)
    if content_type:
        request.add_header("Content-Type", content_type)
    with urllib.request.urlopen(request, timeout=60) as r:
        return json.loads(r.read() or b"null")


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime


class _Server:
    def __init__(self, data_dir: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "node", "--log-level", "warning", "serve",
             "--data-dir", str(data_dir), "--port", str(self.port)],
        )  # fmt: skip
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"{self.url}/api/v1/bookie/is_ready", timeout=1).close()
                return
            except OSError:
                time.sleep(0.05)
        self.proc.kill()
        raise SystemExit("bench http: the node did not start")

    def ledgers(self, count: int) -> list[int]:
        return [_call(f"{self.url}/api/v1/ledgers", "POST")["ledgerId"] for _ in range(count)]

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)


def _http_run(
    server: _Server, mode: str, connections: int, seconds: float, ledgers: list[int]
) -> Figures:
    cpu_before = _cpu_seconds(server.proc.pid)
    out = subprocess.run(
        [sys.executable, "-m", "node.bench_http", server.url, mode, str(connections),
         str(seconds), ",".join(map(str, ledgers))],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    cpu = _cpu_seconds(server.proc.pid) - cpu_before
    result = json.loads(out)
    # The server worked through the warm-up too: charge it the measured share of its CPU.
    share = result["seconds"] / (result["seconds"] + WARMUP_S)
    return Figures(
        f"http {mode}",
        result["requests"],
        result["entries"],
        result["seconds"],
        result["latencies"],
        cpu * share,
    )


# --- the engine in-process ----------------------------------------------------------------


async def _engine(data_dir: Path, batch: bool, seconds: float) -> Figures:
    storage = LedgerStorage(load(data_dir=data_dir))
    await storage.start()
    payload = bytes(ENTRY_SIZE)
    payloads = [payload] * BATCH_ENTRIES
    latencies: list[float] = []
    counts = {"requests": 0}
    state = {"recording": False, "running": True}
    ledgers = [(await storage.create_ledger())[0].ledger_id for _ in range(ENGINE_WINDOW)]

    async def slot(ledger: int) -> None:
        while state["running"]:
            started = time.perf_counter()
            if batch:
                await storage.add_entries(ledger, payloads)
            else:
                await storage.add_entry(ledger, None, payload)
            if state["recording"]:
                counts["requests"] += 1
                latencies.append(time.perf_counter() - started)

    tasks = [asyncio.create_task(slot(ledger)) for ledger in ledgers]
    await asyncio.sleep(WARMUP_S)
    state["recording"] = True
    began = time.perf_counter()
    await asyncio.sleep(seconds)
    state["recording"] = False
    elapsed = time.perf_counter() - began
    state["running"] = False
    await asyncio.gather(*tasks)
    await storage.close()
    per_request = BATCH_ENTRIES if batch else 1
    name = "engine batch" if batch else "engine single"
    return Figures(name, counts["requests"], counts["requests"] * per_request, elapsed, latencies)


# --- report ----------------------------------------------------------------------------------


def _print(rows: list[Figures]) -> None:
    print("| run | requests/s | entries/s | MB/s | p50 ms | p99 ms | server cores |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for f in rows:
        cores = f"{f.server_cpu_s / f.seconds:.2f}" if f.server_cpu_s else "-"
        print(
            f"| {f.name} | {f.requests_per_s:,.0f} | {f.entries_per_s:,.0f} | "
            f"{f.entries_per_s * ENTRY_SIZE / MB:,.1f} | {f.latency_ms(0.5):.2f} | "
            f"{f.latency_ms(0.99):.2f} | {cores} |"
        )


def main(args: argparse.Namespace) -> int:
    connections = args.writers
    seconds = args.seconds
    scratch = Path(tempfile.mkdtemp(prefix="node-bench-http-", dir=args.dir))
    try:
        print(f"## node bench http: {connections} connections, {seconds} s per run, 1 KiB entries")
        print(f"- scratch: {scratch}; python {sys.version.split()[0]}; {os.cpu_count()} CPUs")
        server = _Server(scratch / "server")
        try:
            read_ledger = server.ledgers(1)
            fill = encode_batch([bytes(ENTRY_SIZE)] * BATCH_ENTRIES)
            for _ in range(READ_LEDGER_ENTRIES // BATCH_ENTRIES):
                _call(
                    f"{server.url}/api/v1/ledgers/{read_ledger[0]}/entries",
                    "POST",
                    fill,
                    BATCH_CONTENT_TYPE,
                )
            rows = [
                _http_run(server, "single", connections, seconds, server.ledgers(connections)),
                _http_run(server, "batch", connections, seconds, server.ledgers(connections)),
                _http_run(server, "read", connections, seconds, read_ledger),
            ]
        finally:
            server.stop()
        tune_gc()
        rows.append(run(_engine(scratch / "engine-single", False, seconds)))
        rows.append(run(_engine(scratch / "engine-batch", True, seconds)))
        _print(rows)
        single, batch = rows[0], rows[1]
        engine_batch = rows[4]
        per_core = single.requests_per_s / (single.server_cpu_s / single.seconds)
        print()
        print(
            f"- batch ingest over HTTP / in-process engine batches: "
            f"{batch.entries_per_s / engine_batch.entries_per_s:.0%} (target >= 50%)"
        )
        print(f"- single adds per server core: {per_core:,.0f}/s (target >= 5,000/s)")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    load_main(sys.argv[1:])
