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

MB/s is bytes of log per second of wall time, the best of ROUNDS scans. "cores" is the CPU
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
    PAYLOAD_FILL,
    machine_line,
    markdown_table,
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
ROUNDS = 2  # scans per runner; the best is reported (a shared machine is noisy)
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


def _timed(scan: Any) -> tuple[float, float, Any]:
    """The best of ROUNDS runs of ``scan()``: (wall seconds, cores busy, its result)."""
    best: tuple[float, float, Any] | None = None
    for _ in range(ROUNDS):
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


def inspect_pass(ledgers_dir: Path) -> Scan:
    def scan() -> tuple[int, int]:
        records = bad = 0
        for log_id in entrylog.list_logs(ledgers_dir):
            for record in entrylog.scan(logformat.log_path(ledgers_dir, log_id)):
                records += 1
                bad += not record.crc_ok
        return records, bad

    seconds, cores, (records, bad) = _timed(scan)
    return Scan("inspect (1 thread)", seconds, records, bad, cores=cores)


def spark_pass(master: str, ledgers_dir: Path, split_bytes: int) -> Scan:
    from node.audit import job, ranges, source

    logs = [
        (NODE, str(ledgers_dir), log_id, logformat.log_path(ledgers_dir, log_id).stat().st_size)
        for log_id in entrylog.list_logs(ledgers_dir)
    ]
    planned = sum(len(ranges.plan_ranges(size, split_bytes)) for *_, size in logs)
    spark = job.spark_session(master)
    try:
        first = logs[:1]
        warm = [(n, d, i, min(s, logformat.HEADER_SIZE + split_bytes)) for n, d, i, s in first]
        source.read_records(spark, warm, split_bytes).count()
        df = source.read_records(spark, logs, split_bytes)
        reported = df.rdd.getNumPartitions()

        def scan() -> Any:
            # A new DataFrame each round: collecting the same one again would reuse the
            # first round's shuffle output and skip the scan.
            records = source.read_records(spark, logs, split_bytes)
            query = records.selectExpr("count(*) AS n", "sum(CAST(NOT crc_ok AS INT)) AS bad")
            return query.collect()

        seconds, cores, rows = _timed(scan)
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


def main(args: argparse.Namespace) -> int:
    require_positive(gib=args.gib, entry_size=args.entry_size, split_mib=args.split_mib)
    with scratch_dir(args.dir, "bench-audit-") as scratch:
        data_dir = scratch / "data"
        total = int(args.gib * GiB)
        print(f"building {total / MB:.0f} MB of entry logs ({args.entry_size} B entries) ...")
        entries = asyncio.run(build(data_dir, total, args.entry_size))
        ledgers_dir = data_dir / "ledgers"
        log_bytes = sum(p.stat().st_size for p in ledgers_dir.glob(f"*{logformat.SUFFIX}"))
        split = int(args.split_mib * MiB)
        scans = [spark_pass(master, ledgers_dir, split) for master in MASTERS]
        scans.append(inspect_pass(ledgers_dir))
        report(scans, entries, log_bytes, scratch)
    return 0


def report(scans: list[Scan], entries: int, log_bytes: int, scratch: Path) -> None:
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
