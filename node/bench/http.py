"""``python -m node bench http``: the live server over loopback, driven by a separate load
process, next to the in-process engine measured in the same run.

Runs, each for ``--seconds`` after a warm-up:
- single adds: POST one 1 KiB entry per request, from ``--connections`` connections;
- batch adds: POST 100 entries of 1 KiB per request (one durable acknowledgment);
- reads: GET one entry per request, spread over a pre-filled ledger;
- the engine in-process: the same single adds and batches without HTTP.

Targets: batch ingest over HTTP at least 50% of the in-process engine's entries/s
for the same batches; single adds at least 5,000/s per core of the server process (its CPU
time is read from /proc, so the figure does not depend on how many cores the box has).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

from node.bench.common import Phase, markdown_table, scratch_dir
from node.bench.server import (
    BATCH_ENTRIES,
    ENTRY_SIZE,
    WARMUP_S,
    Figures,
    Server,
    call,
    serving,
    short_machine_line,
)
from node.runtime import run, tune
from node.settings import load
from node.storage.ledgers import LedgerStorage
from node.wire import BATCH_CONTENT_TYPE, OCTET_CONTENT_TYPE, encode_batch

READ_LEDGER_ENTRIES = 20_000  # entries pre-filled for the read run
ENGINE_WINDOW = 64  # adds in flight in-process, as many as the HTTP run's connections


# --- the load process ----------------------------------------------------------------------


async def _load(
    url: str, mode: str, connections: int, seconds: float, ledgers: list[int]
) -> dict[str, Any]:
    import aiohttp  # the load process only

    if mode == "batch":
        body = encode_batch([bytes(ENTRY_SIZE)] * BATCH_ENTRIES)
        headers, entries = {"Content-Type": BATCH_CONTENT_TYPE}, BATCH_ENTRIES
    else:  # single adds; reads: one entry a request too
        body, headers, entries = bytes(ENTRY_SIZE), {"Content-Type": OCTET_CONTENT_TYPE}, 1
    latencies: list[float] = []
    counts = {"requests": 0, "entries": 0, "errors": 0}
    phase = Phase()

    async def worker(n: int, session: aiohttp.ClientSession) -> None:
        rng = random.Random(n)
        entries_url = f"{url}/api/v1/ledgers/{ledgers[n % len(ledgers)]}/entries"
        while phase.running:
            started = time.perf_counter()
            if mode == "read":
                entry = rng.randrange(READ_LEDGER_ENTRIES)
                request = session.get(f"{url}/api/v1/ledgers/{ledgers[0]}/entries/{entry}")
            else:
                request = session.post(entries_url, data=body, headers=headers)
            async with request as response:
                await response.read()
                ok = response.status < 300
            if phase.recording:
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
        elapsed = await phase.record(seconds)
        phase.running = False
        await asyncio.gather(*tasks)
    return {**counts, "seconds": elapsed, "latencies": latencies}


def load_main(argv: list[str]) -> None:
    url, mode, connections, seconds, ledgers = argv
    result = run(
        _load(url, mode, int(connections), float(seconds), [int(x) for x in ledgers.split(",")])
    )
    json.dump(result, sys.stdout)


# --- over HTTP -------------------------------------------------------------------------------


def _http_run(
    server: Server, mode: str, connections: int, seconds: float, ledgers: list[int]
) -> Figures:
    result, server_cpu_s = server.load(
        "node.bench.http", mode, connections, seconds, ",".join(map(str, ledgers))
    )
    return Figures(
        f"http {mode}",
        result["requests"],
        result["entries"],
        result["seconds"],
        result["latencies"],
        server_cpu_s,
    )


# --- the engine in-process ----------------------------------------------------------------


async def _engine(data_dir: Path, batch: bool, seconds: float) -> Figures:
    storage = LedgerStorage(load(data_dir=data_dir))
    await storage.start()
    payload = bytes(ENTRY_SIZE)
    payloads = [payload] * BATCH_ENTRIES
    latencies: list[float] = []
    counts = {"requests": 0}
    phase = Phase()
    ledgers = [(await storage.create_ledger())[0].ledger_id for _ in range(ENGINE_WINDOW)]

    async def slot(ledger: int) -> None:
        while phase.running:
            started = time.perf_counter()
            if batch:
                await storage.add_entries(ledger, payloads)
            else:
                await storage.add_entry(ledger, None, payload)
            if phase.recording:
                counts["requests"] += 1
                latencies.append(time.perf_counter() - started)

    tasks = [asyncio.create_task(slot(ledger)) for ledger in ledgers]
    await asyncio.sleep(WARMUP_S)
    elapsed = await phase.record(seconds)
    phase.running = False
    await asyncio.gather(*tasks)
    await storage.close()
    per_request = BATCH_ENTRIES if batch else 1
    name = "engine batch" if batch else "engine single"
    return Figures(name, counts["requests"], counts["requests"] * per_request, elapsed, latencies)


# --- report ----------------------------------------------------------------------------------


def _table(rows: list[Figures]) -> list[str]:
    header = ("run", "requests/s", "entries/s", "MB/s", "p50 ms", "p99 ms", "server cores")
    return markdown_table(header, [(*f.cells(), f.cores) for f in rows])


def main(args: argparse.Namespace) -> int:
    if args.peer:
        from node.bench import peer

        return peer.main(args)
    connections = args.writers
    seconds = args.seconds
    with scratch_dir(args.dir, "node-bench-http-") as scratch:
        print(f"## node bench http: {connections} connections, {seconds} s per run, 1 KiB entries")
        print(short_machine_line(scratch))
        with serving(scratch / "server") as server:
            read_ledger = server.ledgers(1)
            fill = encode_batch([bytes(ENTRY_SIZE)] * BATCH_ENTRIES)
            for _ in range(READ_LEDGER_ENTRIES // BATCH_ENTRIES):
                call(
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
        tune()
        rows.append(run(_engine(scratch / "engine-single", False, seconds)))
        rows.append(run(_engine(scratch / "engine-batch", True, seconds)))
        print("\n".join(_table(rows)))
        single, batch = rows[0], rows[1]
        engine_batch = rows[4]
        per_core = single.requests_per_s / (single.server_cpu_s / single.seconds)
        print()
        print(
            f"- batch ingest over HTTP / in-process engine batches: "
            f"{batch.entries_per_s / engine_batch.entries_per_s:.0%} (target >= 50%)"
        )
        print(f"- single adds per server core: {per_core:,.0f}/s (target >= 5,000/s)")
    return 0


if __name__ == "__main__":
    load_main(sys.argv[1:])
