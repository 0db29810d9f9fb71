"""``python -m node bench stream``: stream appends and end-to-end latency over HTTP, against a
live node this command starts, driven by a separate load process (as ``bench http``).

Runs, each for ``--seconds`` after a warm-up, each on a fresh stream whose ledgers roll over
every ``ROLLOVER_ENTRIES`` entries (so appends and reads cross ledger boundaries, as they do
in production):
- single appends: POST one 1 KiB entry per request from ``--writers`` connections;
- batch appends: POST 100 entries of 1 KiB per request (one durable acknowledgment);
- tail (long poll): writers append single entries while one reader tails the stream with
  ``GET /api/v1/streams/{name}/entries?from=...&waitMs=...``, following X-Next-Position;
  once with one writer (an idle node: the latency floor), once with ``--writers``;
- tail (cursor): the same with ``--writers``, the reader taking a cursor's entries
  (long poll) and acknowledging the last of each read before the next.

With ``--dedup``: single and batch appends with producer headers (``X-Producer-Id``,
``X-Sequence-Id``; each writer a producer) on deduplicating streams against the same without,
alternating, twice each, with the node's CPU per 1,000 entries: on a machine shared with other
work the CPU per entry is the figure to compare, not the rate.

With ``--replicated``: replicated streams on a local cluster against a single node's
(stream_replicated.py), which also uses this load process's ``tail-paced`` mode: one writer at
``TAIL_RATE`` appends/s and the reader long-polling, perhaps on another node than the writer's.

End-to-end latency: each payload starts with the monotonic time its append started (in
the load process, which also runs the reader); the reader's receipt minus it. It covers
the durable append (group commit and fsync), the wake-up of the long poll and the read.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import struct
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from node.bench.common import P50, P99, Phase, markdown_table, quantile_ms, scratch_dir
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
from node.wire import (
    BATCH_CONTENT_TYPE,
    JSON_CONTENT_TYPE,
    OCTET_CONTENT_TYPE,
    decode_stream_frames,
    encode_batch,
)

ROLLOVER_ENTRIES = 10_000  # maxEntriesPerLedger of the bench's streams
POLICIES = {"maxEntriesPerLedger": ROLLOVER_ENTRIES, "minLedgerRolloverTimeMinutes": 0}
READ_LIMIT = 1000  # entries per read of the tailing reader
TAIL_WAIT_MS = 1000  # the reader's long poll
DRAIN_WAIT_MS = 100  # after the writers stop: the reader reads until a poll this long is empty
DRAIN_TIMEOUT_S = 30.0  # ... but gives up on the rest after this long
STAMP = struct.Struct(">Q")  # the append's start, perf_counter_ns, at the payload's head
NEVER_NS = 1 << 63  # after any perf_counter_ns
NS_PER_S = 1e9

TAIL_RATE = 100  # appends/s of the paced tail's one writer: far below what a node sustains
SINGLE, BATCH, TAIL_READ, TAIL_CURSOR = "single", "batch", "tail-read", "tail-cursor"
TAIL_PACED = "tail-paced"  # one writer at TAIL_RATE, the reader long-polling (stream_replicated)
# Appends with producer headers on a deduplicating stream (node/streams/dedup.py)
SINGLE_DEDUP, BATCH_DEDUP = "single-dedup", "batch-dedup"
DEDUP_MODES = {SINGLE_DEDUP: SINGLE, BATCH_DEDUP: BATCH}  # -> the same appends without
DEDUP_POLICIES = {**POLICIES, "deduplication": True}
DEDUP_TARGET = 1.2  # the bound: CPU per entry with the headers over without


@dataclass(slots=True)
class StreamFigures(Figures):
    """``latencies`` are the appends'; the tail runs add the end-to-end ones."""

    e2e_latencies: list[float] = field(default_factory=list, repr=False)
    appended_in_window: int = 0  # tail runs: entries whose append started in the window ...
    delivered_in_window: int = 0  # ... and how many of them the reader received
    ledgers: int = 0


def _stamped(size: int) -> bytes:
    return STAMP.pack(time.perf_counter_ns()) + bytes(size - STAMP.size)


# --- the load process ----------------------------------------------------------------------


async def _load(
    url: str, mode: str, connections: int, seconds: float, stream: str, reader_url: str = ""
) -> dict[str, Any]:
    """``reader_url``: the node the tailing reader asks (default: ``url``, the writers')."""
    import aiohttp  # the load process only

    base = f"{url}/api/v1/streams/{stream}"
    read_base = f"{reader_url or url}/api/v1/streams/{stream}"
    batch = encode_batch([bytes(ENTRY_SIZE)] * BATCH_ENTRIES)
    appends: list[float] = []
    starts: list[int] = []  # perf_counter_ns of every acknowledged single append
    e2e: list[float] = []
    # misread: an entry received cut, or (one paced writer) out of its append order
    counts = {"requests": 0, "entries": 0, "errors": 0, "delivered": 0, "misread": 0}
    last_stamp = [-1]
    phase = Phase()
    draining = False
    # perf_counter_ns of the measured window; until it opens, no stamp is in it.
    window = {"start": NEVER_NS, "end": NEVER_NS}
    producers = iter(range(connections))
    dedup = mode in DEDUP_MODES
    shape = DEDUP_MODES.get(mode, mode)

    async def writer(session: aiohttp.ClientSession) -> None:
        next_send = time.perf_counter()
        headers = {}
        if dedup:
            headers = {"X-Producer-Id": f"bench-{next(producers)}"}
        sequence = 0
        while phase.running:
            if mode == TAIL_PACED:  # a steady rate: the latency of a light load, no queue
                await asyncio.sleep(max(0.0, next_send - time.perf_counter()))
                next_send = max(next_send + 1 / TAIL_RATE, time.perf_counter())
            started = time.perf_counter()
            if shape == BATCH:
                body, content_type, entries = batch, BATCH_CONTENT_TYPE, BATCH_ENTRIES
            else:
                body, content_type, entries = _stamped(ENTRY_SIZE), OCTET_CONTENT_TYPE, 1
            if dedup:
                headers["X-Sequence-Id"] = str(sequence)
                sequence += entries
            async with session.post(
                f"{base}/entries", data=body, headers={"Content-Type": content_type, **headers}
            ) as response:
                await response.read()
                ok = response.status == 201
            if ok and shape != BATCH:
                starts.append(STAMP.unpack_from(body)[0])
            if phase.recording:
                if ok:
                    counts["requests"] += 1
                    counts["entries"] += entries
                    appends.append(time.perf_counter() - started)
                else:
                    counts["errors"] += 1

    def receive(body: bytes) -> str | None:
        """Latencies of what a read brought; the position of its last entry."""
        received = time.perf_counter_ns()
        last = None
        for position, payload in decode_stream_frames(body):
            (stamp,) = STAMP.unpack_from(payload)
            if len(payload) != ENTRY_SIZE or (mode == TAIL_PACED and stamp <= last_stamp[0]):
                counts["misread"] += 1
            last_stamp[0] = stamp
            if window["start"] <= stamp <= window["end"]:
                counts["delivered"] += 1
                e2e.append((received - stamp) / NS_PER_S)
            last = str(position)
        return last

    async def reader(session: aiohttp.ClientSession) -> None:
        position = None
        while True:
            wait_ms = DRAIN_WAIT_MS if draining else TAIL_WAIT_MS
            query = f"limit={READ_LIMIT}&waitMs={wait_ms}"
            if mode == TAIL_CURSOR:
                url = f"{read_base}/cursors/tail/entries?{query}"
            else:
                url = f"{read_base}/entries?{query}" + (f"&from={position}" if position else "")
            async with session.get(url) as response:
                body = await response.read()
                if response.status != 200:
                    counts["errors"] += 1
                    if draining:
                        return
                    continue
                position = response.headers.get("X-Next-Position", position)
            last = receive(body)
            if last is not None and mode == TAIL_CURSOR:
                async with session.post(
                    f"{read_base}/cursors/tail/ack", json={"position": last}
                ) as response:
                    await response.read()
            if last is None and draining:
                return

    tailing = mode in (TAIL_READ, TAIL_CURSOR, TAIL_PACED)
    async with (
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=connections)) as writers,
        aiohttp.ClientSession() as readers,  # its own connection, never queued behind appends
    ):
        if mode == TAIL_CURSOR:
            async with readers.put(
                f"{read_base}/cursors/tail", json={"start": "earliest"}
            ) as response:
                assert response.status == 201, await response.text()
        read_task = asyncio.create_task(reader(readers)) if tailing else None
        tasks = [asyncio.create_task(writer(writers)) for _ in range(connections)]
        await asyncio.sleep(WARMUP_S)
        window["start"] = time.perf_counter_ns()
        elapsed = await phase.record(seconds)
        window["end"] = time.perf_counter_ns()
        phase.running = False
        await asyncio.gather(*tasks)
        if read_task is not None:
            draining = True
            # Past the timeout the report shows fewer entries delivered than appended.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(read_task, DRAIN_TIMEOUT_S)
    return {
        **counts,
        "seconds": elapsed,
        "appends": appends,
        "e2e": e2e,
        "appended_in_window": sum(window["start"] <= s <= window["end"] for s in starts)
        if tailing
        else 0,
    }


def load_main(argv: list[str]) -> None:
    from node.runtime import run

    url, mode, connections, seconds, stream, *reader_url = argv
    result = run(_load(url, mode, int(connections), float(seconds), stream, *reader_url))
    json.dump(result, sys.stdout)


# --- the runs --------------------------------------------------------------------------------


def _run(
    server: Server, name: str, mode: str, writers: int, seconds: float, n: int
) -> StreamFigures:
    stream = f"bench-{n}"
    body = json.dumps(DEDUP_POLICIES if mode in DEDUP_MODES else POLICIES).encode()
    call(f"{server.url}/api/v1/streams/{stream}", "PUT", body, JSON_CONTENT_TYPE)
    result, server_cpu_s = server.load("node.bench.stream", mode, writers, seconds, stream)
    details = call(f"{server.url}/api/v1/streams/{stream}")
    return StreamFigures(
        name=name,
        requests=result["requests"],
        entries=result["entries"],
        seconds=result["seconds"],
        latencies=result["appends"],
        e2e_latencies=result["e2e"],
        appended_in_window=result["appended_in_window"],
        delivered_in_window=result["delivered"],
        ledgers=len(details["ledgers"]),
        server_cpu_s=server_cpu_s,
    )


def _table(rows: list[StreamFigures]) -> list[str]:
    header = (
        "run",
        "appends/s",
        "entries/s",
        "MB/s",
        "append p50 ms",
        "append p99 ms",
        "end-to-end p50 ms",
        "end-to-end p99 ms",
        "ledgers",
        "server cores",
    )
    cells = []
    for f in rows:
        e2e = f.e2e_latencies
        cells.append(
            (
                *f.cells(),
                f"{quantile_ms(e2e, P50):.2f}" if e2e else "-",
                f"{quantile_ms(e2e, P99):.2f}" if e2e else "-",
                str(f.ledgers),
                f.cores,
            )
        )
    return markdown_table(header, cells)


def per_thousand_ms(f: Figures) -> float:
    """The node's CPU milliseconds per 1,000 entries appended."""
    return f.server_cpu_s * 1e6 / f.entries if f.entries else 0.0


def dedup_runs(writers: int) -> list[tuple[str, str, int]]:
    """(name, mode, writers): each shape without and with producer headers, twice, in the
    order without, with, with, without: the node's data grows from run to run (its write
    cache, entry logs and checkpoints cost more), and the later runs must not all be one
    side's."""
    runs = []
    for with_headers, plain in DEDUP_MODES.items():
        shape = "single appends" if plain == SINGLE else f"batch appends ({BATCH_ENTRIES} x 1 KiB)"
        without = [(f"{shape}, {writers} writers (#{n})", plain, writers) for n in (1, 2)]
        headed = [
            (f"{shape}, producer headers, {writers} writers (#{n})", with_headers, writers)
            for n in (1, 2)
        ]
        runs += [without[0], headed[0], headed[1], without[1]]
    return runs


def dedup_lines(rows: Sequence[Figures], modes: list[str]) -> list[str]:
    """CPU per 1,000 entries of each run, and per shape: with the headers over without."""
    lines = [f"- {f.name}: node CPU {per_thousand_ms(f):.1f} ms per 1,000 entries" for f in rows]
    for with_headers, plain in DEDUP_MODES.items():
        cost = {
            mode: sum(f.server_cpu_s for f, m in zip(rows, modes, strict=True) if m == mode)
            / max(1, sum(f.entries for f, m in zip(rows, modes, strict=True) if m == mode))
            for mode in (plain, with_headers)
        }
        # The least CPU per entry of each: a run the machine's other work slowed (fewer
        # appends sharing each fsync, caches cold) costs more per entry, never less.
        best = {
            mode: min(
                (per_thousand_ms(f) for f, m in zip(rows, modes, strict=True) if m == mode),
                default=0.0,
            )
            for mode in (plain, with_headers)
        }
        if cost[plain] and best[plain]:
            ratio = cost[with_headers] / cost[plain]
            least = best[with_headers] / best[plain]
            met = "met" if min(ratio, least) <= DEDUP_TARGET else "MISSED"
            lines.append(
                f"- {plain} appends: CPU per entry with producer headers / without = "
                f"{ratio:.2f}x over all runs, {least:.2f}x of the best runs (target <= "
                f"{DEDUP_TARGET}x: {met})"
            )
    return lines


def main(args: argparse.Namespace) -> int:
    writers = args.writers
    seconds = args.seconds
    if args.dedup:
        return _dedup_main(args)
    runs = [
        (f"single appends, {writers} writers", SINGLE, writers),
        (f"batch appends ({BATCH_ENTRIES} x 1 KiB), {writers} writers", BATCH, writers),
        ("tail (long poll), 1 writer", TAIL_READ, 1),
        (f"tail (long poll), {writers} writers", TAIL_READ, writers),
        (f"tail (cursor + ack), {writers} writers", TAIL_CURSOR, writers),
    ]
    with scratch_dir(args.dir, "node-bench-stream-") as scratch:
        print(
            f"## node bench stream: {seconds} s per run, 1 KiB entries, ledgers of "
            f"{ROLLOVER_ENTRIES:,} entries"
        )
        print(short_machine_line(scratch))
        with serving(scratch / "server") as server:
            rows = [
                _run(server, name, mode, count, seconds, n)
                for n, (name, mode, count) in enumerate(runs)
            ]
        print("\n".join(_table(rows)))
        print()
        for f in rows:
            if f.appended_in_window:
                print(
                    f"- {f.name}: the reader received {f.delivered_in_window:,} of the "
                    f"{f.appended_in_window:,} entries appended in the measured window"
                )
    return 0


def _dedup_main(args: argparse.Namespace) -> int:
    runs = dedup_runs(args.writers)
    with scratch_dir(args.dir, "node-bench-stream-dedup-") as scratch:
        print(
            f"## node bench stream --dedup: {args.seconds} s per run, 1 KiB entries, appends "
            "with and without producer headers, alternating"
        )
        print(short_machine_line(scratch))
        with serving(scratch / "server") as server:
            rows = [
                _run(server, name, mode, count, args.seconds, n)
                for n, (name, mode, count) in enumerate(runs)
            ]
        print("\n".join(_table(rows)))
        print()
        print("\n".join(dedup_lines(rows, [mode for _, mode, _ in runs])))
    return 0


if __name__ == "__main__":
    load_main(sys.argv[1:])
