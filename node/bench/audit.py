"""``python -m node bench audit``: the audit's entry-log scan with Spark, local[1] against
local[2], beside the node's own single-threaded ``inspect`` CRC pass, on the same logs.

The data set (in a fresh subdirectory of ``--dir``, or of a temporary directory): ``--gib``
GiB of entry logs written by the engine (``--entry-size`` payloads, several ledgers
interleaved, a checkpoint per batch; logs roll at the node's 1 GiB ``log_size_limit``).

Runs, each over every byte of every log:

1. ``inspect``: ``node.storage.entrylog.scan`` over each log, as ``python -m node inspect
   entrylog`` reads it: one thread, every record's CRC32C checked.
2. Spark ``local[1]`` then ``local[2]``: the audit's Data Source (``node.audit.source``), one
   partition per ``--split-mib`` of log, counting records and bad CRCs; a fresh session per
   master, warmed up on one split first (the JVM, the Python workers). It prints the
   partitions it planned and those Spark reports (``getNumPartitions``): they must agree,
   or the scan is less parallel than the plan.

With ``--http``, a node is started on the data set and takes an audit snapshot (holding
the same logs), and the scan runs again with local[2] reading the logs from the node over
HTTP (``node.audit.remote``), the node's CPU per second of the scan beside it: once without
the node's pace (``audit_serve_bytes_per_s`` 0), measured as the local-file rows are (a
warmed-up session, the best of --rounds, nothing else running), and once with ``--pace-mib``
(its default). A writer adds 1 KiB entries one at a time (each acknowledged after its
fsync): their p99 with no scan, during one more uncapped scan and during the capped one is
what the pace is for.

MB/s is bytes of log per second of wall time, the best of --rounds scans. "cores" is the CPU
time of this process and all its descendants (the JVM, Spark's Python workers) over the
scan, per second of wall time: how many cores the scan kept busy. The logs were just
written, so they are read from the page cache when they fit in memory: the figures are
then the scan's CPU cost (CRC32C, unpacking headers, building Arrow batches in Python,
handing them to the JVM), not the disk's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node.bench.common import (
    MB,
    P99,
    PAYLOAD_FILL,
    machine_line,
    markdown_table,
    quantile_ms,
    require_positive,
    scratch_dir,
)
from node.settings import GiB, MiB, Settings, load
from node.storage import entrylog, logformat
from node.storage.ledgers import LedgerStorage

LEDGERS = 4  # interleaved, as a node's logs are
BATCH_BYTES = 16 * MiB  # payload per add_entries call and checkpoint
MASTERS = ("local[1]", "local[2]")
NODE = "bench"
DEFAULT_ROUNDS = 2  # scans per runner (--rounds); the best is reported (a shared machine is noisy)
HTTP_MASTER = "local[2]"
ADD_BYTES = 1024  # the adds measured beside the scan over HTTP
IDLE_ADDS_S = 5.0  # adds with no scan: their p99 is the baseline
HTTP_CREATED = 201
GB = 1000 * MB
# /proc/<pid>/stat after the command's ")": state is field 3, so field n is at n - 3.
PPID_FIELD = 4 - 3
CPU_FIELDS = slice(14 - 3, 17 - 3 + 1)  # utime, stime, cutime, cstime (reaped children)


@dataclass(slots=True)
class Scan:
    name: str
    seconds: float
    records: int
    bad_crc: int
    partitions: str = "-"
    cores: float = 0.0
    node_cpu_s: float = 0.0  # the node's serving it (over HTTP)

    def cpu_s_per_gb(self, log_bytes: int) -> float:
        """CPU seconds the scan took per GB of log, the node's included."""
        return (self.cores * self.seconds + self.node_cpu_s) / (log_bytes / GB)


def tree_cpu_seconds(root: int) -> float:
    """CPU seconds of ``root`` and every process below it (Linux /proc), reaped ones
    included through their parents' cutime and cstime."""
    parents: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue  # exited meanwhile
        pid = int(entry.name)
        parents[pid] = int(fields[PPID_FIELD])
        ticks[pid] = sum(int(v) for v in fields[CPU_FIELDS])
    total = 0
    for pid, cpu in ticks.items():
        ancestor = pid
        while ancestor not in (root, 0, 1) and ancestor in parents:
            ancestor = parents[ancestor]
        if ancestor == root:
            total += cpu
    return total / os.sysconf("SC_CLK_TCK")


def _timed(scan: Any, rounds: int) -> tuple[float, float, Any]:
    """The best of ``rounds`` runs of ``scan()``: (wall seconds, cores busy, its result)."""
    best: tuple[float, float, Any] | None = None
    for _ in range(rounds):
        cpu = tree_cpu_seconds(os.getpid())
        started = time.perf_counter()
        result = scan()
        seconds = time.perf_counter() - started
        cores = (tree_cpu_seconds(os.getpid()) - cpu) / seconds
        if best is None or seconds < best[0]:
            best = (seconds, cores, result)
    assert best is not None
    return best


def _settings(data_dir: Path) -> Settings:
    return load(
        data_dir=data_dir,
        db_storage_write_cache_max_size=4 * BATCH_BYTES,  # a batch fits in one half
        gc_wait_time_ms=3_600_000,  # no GC while the data set is built
    )


async def build(data_dir: Path, total_bytes: int, entry_size: int) -> int:
    """Entry logs holding ``total_bytes`` of payload; returns the number of entries."""
    storage = LedgerStorage(_settings(data_dir))
    await storage.start()
    try:
        ledgers = [(await storage.create_ledger())[0].ledger_id for _ in range(LEDGERS)]
        payload = bytes([PAYLOAD_FILL]) * entry_size
        per_batch = max(1, BATCH_BYTES // entry_size)
        entries = max(1, total_bytes // entry_size)
        written = 0
        while written < entries:
            count = min(per_batch, entries - written)
            await storage.add_entries(ledgers[written % LEDGERS], [payload] * count)
            await storage.checkpoint()
            written += count
    finally:
        await storage.close()
    return written


def inspect_pass(ledgers_dir: Path, rounds: int) -> Scan:
    def scan() -> tuple[int, int]:
        records = bad = 0
        for log_id in entrylog.list_logs(ledgers_dir):
            for record in entrylog.scan(logformat.log_path(ledgers_dir, log_id)):
                records += 1
                bad += not record.crc_ok
        return records, bad

    seconds, cores, (records, bad) = _timed(scan, rounds)
    return Scan("inspect (1 thread)", seconds, records, bad, cores=cores)


def spark_pass(master: str, ledgers_dir: Path, split_bytes: int, rounds: int) -> Scan:
    from node.audit import job, ranges, source

    logs = [
        (NODE, str(ledgers_dir), log_id, logformat.log_path(ledgers_dir, log_id).stat().st_size)
        for log_id in entrylog.list_logs(ledgers_dir)
    ]
    planned = sum(len(ranges.plan_ranges(size, split_bytes)) for *_, size in logs)
    spark = job.spark_session(master)
    try:
        source.read_records(spark, _first_split(logs, split_bytes), split_bytes).count()
        df = source.read_records(spark, logs, split_bytes)
        reported = df.rdd.getNumPartitions()

        def scan() -> Any:
            # A new DataFrame each round: collecting the same one again would reuse the
            # first round's shuffle output and skip the scan.
            records = source.read_records(spark, logs, split_bytes)
            query = records.selectExpr("count(*) AS n", "sum(CAST(NOT crc_ok AS INT)) AS bad")
            return query.collect()

        seconds, cores, rows = _timed(scan, rounds)
    finally:
        spark.stop()
    return Scan(
        f"spark {master}",
        seconds,
        int(rows[0]["n"]),
        int(rows[0]["bad"] or 0),
        f"{planned} planned, {reported} in Spark",
        cores,
    )


class Adds:
    """One writer adding ``ADD_BYTES`` entries one at a time over one connection, in a
    thread, until stopped; the latencies of those that completed."""

    def __init__(self, url: str, ledger_id: int) -> None:
        import threading

        self.url = url
        self.path = f"/api/v1/ledgers/{ledger_id}/entries"
        self.latencies: list[float] = []
        self._cpu_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Adds:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import http.client
        from urllib.parse import urlsplit

        where = urlsplit(self.url)
        connection = http.client.HTTPConnection(where.hostname or "", where.port, timeout=60)
        headers = {"Content-Type": "application/octet-stream"}
        body = bytes([PAYLOAD_FILL]) * ADD_BYTES
        cpu_started = time.thread_time()
        try:
            while not self._stop.is_set():
                started = time.perf_counter()
                connection.request("POST", self.path, body, headers)
                reply = connection.getresponse()
                reply.read()
                if reply.status != HTTP_CREATED:
                    raise SystemExit(f"bench: an add got {reply.status}")
                self.latencies.append(time.perf_counter() - started)
        finally:
            connection.close()
            self._cpu_s = time.thread_time() - cpu_started

    def p99_ms(self) -> float:
        return quantile_ms(self.latencies, P99)

    def cpu_seconds(self) -> float:
        """The writer thread's CPU time, once stopped."""
        return self._cpu_s


def http_passes(
    data_dir: Path, sizes: dict[int, int], split_bytes: int, pace: int, rounds: int
) -> tuple[list[Scan], list[tuple[str, ...]]]:
    """The scan over HTTP without and with the node's pace, and adds' p99 beside it: of
    the logs as they were built (``sizes``), which the snapshots hold (the node appends the
    adds measured to its current log, and the second node the first one's)."""
    from node.audit import job

    spark = job.spark_session(HTTP_MASTER)
    try:
        passes = [http_pass(spark, data_dir, sizes, split_bytes, cap, rounds) for cap in (0, pace)]
    finally:
        spark.stop()
    return [scan for scan, _ in passes], [row for _, row in passes]


def http_pass(
    spark: Any, data_dir: Path, sizes: dict[int, int], split_bytes: int, cap: int, rounds: int
) -> tuple[Scan, tuple[str, ...]]:
    """One node with the pace ``cap``: the scan's row, and the adds' p99 row.

    Without a pace the scan is measured as the local-file rows are, so that the two
    compare: the session warmed up on one split first (a fresh session's Python workers
    import pyspark, pyarrow and the Data Source: seconds of CPU whatever the scan reads),
    the best of ``rounds`` scans, no adds meanwhile (a writer's fsyncs and its thread in this
    process share the cores). The adds' p99 is measured beside one more scan; with a pace
    that scan is the row (one: it takes the logs' size over the pace)."""
    from node.audit import source
    from node.bench.server import call, cpu_seconds, serving

    with serving(data_dir, {"NODE_AUDIT_SERVE_BYTES_PER_S": str(cap)}) as server:
        ledger = call(f"{server.url}/api/v1/ledgers", "POST")["ledgerId"]
        taken = call(f"{server.url}/api/v1/audit/snapshot", "POST")
        logs_url = taken["url"] + "logs"
        logs = [(NODE, logs_url, i, size) for i, size in sorted(sizes.items())]
        source.read_records(spark, _first_split(logs, split_bytes), split_bytes).count()
        name = "no cap" if cap == 0 else f"cap {cap / MB:.0f} MB/s"

        def scan() -> tuple[Any, float]:
            """The scan's row and the node's CPU seconds meanwhile."""
            node_cpu = cpu_seconds(server.proc.pid)
            query = source.read_records(spark, logs, split_bytes).selectExpr(
                "count(*) AS n", "sum(CAST(NOT crc_ok AS INT)) AS bad"
            )
            [row] = query.collect()
            return row, cpu_seconds(server.proc.pid) - node_cpu

        if cap == 0:
            seconds, cores, (row, node_used) = _timed(scan, rounds)
            # The node is this process's child: its CPU is not the scan's.
            measured = _http_scan(name, seconds, cores - node_used / seconds, row, node_used)
        with Adds(server.url, ledger) as idle:
            time.sleep(IDLE_ADDS_S)
        with Adds(server.url, ledger) as busy:
            tree_cpu = tree_cpu_seconds(os.getpid())
            started = time.perf_counter()
            row, node_used = scan()
            seconds = time.perf_counter() - started
            tree_used = tree_cpu_seconds(os.getpid()) - tree_cpu
        if cap != 0:
            # The node's CPU and the writer's are not the scan's.
            cores = (tree_used - node_used - busy.cpu_seconds()) / seconds
            measured = _http_scan(name, seconds, cores, row, node_used)
    ratio = busy.p99_ms() / max(idle.p99_ms(), 1e-9)
    p99s = (f"{idle.p99_ms():.1f}", f"{busy.p99_ms():.1f}", f"{ratio:.2f}")
    return measured, (name, *p99s, str(len(busy.latencies)))


def _first_split(logs: list[Any], split_bytes: int) -> list[Any]:
    """The warm-up's logs: the first split of the first log."""
    return [(n, d, i, min(s, logformat.HEADER_SIZE + split_bytes)) for n, d, i, s in logs[:1]]


def _http_scan(name: str, seconds: float, cores: float, row: Any, node_cpu_s: float) -> Scan:
    return Scan(
        f"spark {HTTP_MASTER} over HTTP, {name}",
        seconds,
        int(row["n"]),
        int(row["bad"] or 0),
        f"node {node_cpu_s / seconds:.2f} cores",
        cores,
        node_cpu_s,
    )


def main(args: argparse.Namespace) -> int:
    rounds = DEFAULT_ROUNDS if args.rounds is None else args.rounds
    require_positive(
        gib=args.gib, entry_size=args.entry_size, split_mib=args.split_mib, rounds=rounds
    )
    with scratch_dir(args.dir, "bench-audit-") as scratch:
        data_dir = scratch / "data"
        total = int(args.gib * GiB)
        print(f"building {total / MB:.0f} MB of entry logs ({args.entry_size} B entries) ...")
        entries = asyncio.run(build(data_dir, total, args.entry_size))
        ledgers_dir = data_dir / "ledgers"
        log_bytes = sum(p.stat().st_size for p in ledgers_dir.glob(f"*{logformat.SUFFIX}"))
        split = int(args.split_mib * MiB)
        scans = [spark_pass(master, ledgers_dir, split, rounds) for master in MASTERS]
        scans.append(inspect_pass(ledgers_dir, rounds))
        latency_rows: list[tuple[str, ...]] = []
        if args.http:
            sizes = {
                i: logformat.log_path(ledgers_dir, i).stat().st_size
                for i in entrylog.list_logs(ledgers_dir)
            }
            pace = int(args.pace_mib * MiB)
            over_http, latency_rows = http_passes(data_dir, sizes, split, pace, rounds)
            scans += over_http
        report(scans, entries, log_bytes, scratch, latency_rows)
    return 0


def report(
    scans: list[Scan],
    entries: int,
    log_bytes: int,
    scratch: Path,
    latency_rows: list[tuple[str, ...]] | None = None,
) -> None:
    rows: list[tuple[str, ...]] = [
        (
            s.name,
            f"{log_bytes / MB / s.seconds:.0f}",
            f"{s.seconds:.2f}",
            f"{s.cores:.2f}",
            str(s.records),
            str(s.bad_crc),
            s.partitions,
        )
        for s in scans
    ]
    print()
    print(f"## bench audit: {log_bytes / MB:.0f} MB of entry logs, {entries} entries")
    print(machine_line(scratch))
    print()
    header = ("scan", "MB/s", "seconds", "cores", "records", "bad CRC", "partitions")
    for line in markdown_table(header, rows):
        print(line)
    by_name: dict[str, Any] = {s.name: s for s in scans}
    one, two = by_name["spark local[1]"], by_name["spark local[2]"]
    print()
    print(f"local[2] / local[1]: {one.seconds / two.seconds:.2f}x")
    uncapped = next((s for s in scans if s.name.endswith("no cap")), None)
    if uncapped is not None:
        print(f"over HTTP / local files (local[2]): {two.seconds / uncapped.seconds:.2f}x")
        # What a shared machine's load changes least: the CPU each way costs per byte.
        print(
            f"CPU s per GB of log: local files {two.cpu_s_per_gb(log_bytes):.2f}, over HTTP "
            f"{uncapped.cpu_s_per_gb(log_bytes):.2f} (the node's "
            f"{uncapped.node_cpu_s / (log_bytes / GB):.2f})"
        )
    if latency_rows:
        print()
        print(f"adds of {ADD_BYTES} B, one at a time: p99 ms with no scan, during the scan")
        print()
        pace = ("node's pace", "p99 idle", "p99 during scan", "ratio", "adds during scan")
        for line in markdown_table(pace, latency_rows):
            print(line)
