"""``python -m node bench wal [--path DEV_OR_FILE]``: the raw-device WAL against ``fio`` on the
same device, in the same run.

Media: by default a loop device made for the run (over a zero-filled file in the scratch
directory) and a plain file next to it, both on the disk that holds ``--dir``; with
``--path``, that block device or file only (256 MiB at least; its contents are overwritten).

On each medium, per record size (``--record-sizes``, default 1 KiB, 16 KiB, 256 KiB):

- **wal unthrottled**: ``--writers`` appenders back to back (each awaits its append's
  durable acknowledgment, then appends again), ``wal_write_rate_limit`` off.
- **wal at target**: appends issued at a fixed rate, the budget of an AWS gp3 volume's
  baseline (3,000 IOPS, 125 MiB/s): min(3,000/s, 125 MiB/s / record size), with the
  default settings (so the 3,000 blocks/s limit is on).
- **fio**: sequential writes, ``direct=1``, ``ioengine=libaio``, ``iodepth`` = the WAL's
  ``wal_io_depth``, block size = the WAL's average block in the unthrottled run (4 KiB
  aligned), with the WAL's durability: ``sync=dsync`` (each write on stable storage when it
  completes), since the WAL acknowledges only durable blocks (``wal_sync_mode``: written
  with O_DSYNC, or fdatasynced). Ratio = WAL device MiB/s / fio.

The WAL's unthrottled runs and fio alternate, ``ROUNDS`` rounds of ``--seconds`` / ``ROUNDS``
each, the WAL first in even rounds and fio first in odd ones (the machine's load drifts;
alternating gives both the same share of it). The table adds the rounds up; the ratio judged
against the target is the median of the per-round ratios (one round that a neighbour's burst
hit moves it little), printed with the pooled ratio (totals over totals) and every round's.

Then IOPS: the WAL with 4 KiB blocks (``wal_block_soft_limit`` = 4 KiB and records that fill
one block each), unthrottled, against fio at ``bs=4k``. fio without sync is printed as a
reference (what the device does when nothing is flushed).

Columns: appends/s; payload MiB/s; writes/s (device IOPS: blocks, or fio's I/Os); device
MiB/s (blocks as written: record headers and 4 KiB padding included); average write; p50 and
p99 latency (an append, from the call to its durable acknowledgment; fio: completion latency
of one I/O). MiB = 2^20 bytes. The record CRC is computed once per run: the engine computes
it per entry before the WAL, so it is not part of the WAL's cost.

Targets: at least 80% of fio's bandwidth at 256 KiB and 80% of fio's IOPS at 4 KiB.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from node.bench.common import (
    MS_PER_S,
    P50,
    P99,
    PAYLOAD_FILL,
    Phase,
    UsageError,
    machine_line,
    markdown_table,
    parse_sizes,
    quantile_ms,
    require_positive,
    scratch_dir,
    warmup_for,
)
from node.runtime import run, tune
from node.settings import KiB, MiB, Settings, load
from node.storage.blockwal import BlockWal
from node.storage.clock import SystemClock
from node.storage.directio import aligned_buffer, create_file, open_raw, write_exactly
from node.storage.faults import Faults
from node.storage.ringformat import BLOCK_ALIGNMENT, HEADER_AREA, RECORD_OVERHEAD
from node.storage.wal import record_crc

RING_CAPACITY = 256 * MiB  # large enough that trims, not the ring's size, pace the writes
DEFAULT_RECORD_SIZES = "1024,16384,262144"
GP3_IOPS = 3000  # AWS gp3 baseline
GP3_BYTES_PER_S = 125 * MiB
IOPS_BLOCK = 4 * KiB  # the block size of the IOPS comparison
OPEN_LOOP_TICK_S = 0.0005  # the rate generator wakes this often (uvloop rounds to 1 ms)
LOSETUP_TIMEOUT_S = 30
FIO_TIMEOUT_MARGIN_S = 60  # fio gets its runtime plus this before it counts as hung
TARGET_RATIO = 0.80
ROUNDS = 6  # WAL and fio alternate this many times per comparison (even: each goes first as often)
BENCH_LEDGER = 1  # ledger id of every record (the bench does not recover them)


@dataclass(slots=True)
class Row:
    """One measured run (WAL or fio): figures per second over ``seconds``."""

    name: str
    record_size: int  # 0 for fio
    appends: int
    payload_bytes: int
    writes: int
    device_bytes: int
    seconds: float
    latencies: list[float] = field(repr=False)
    p50_s: float | None = None  # given by fio, else from latencies
    p99_s: float | None = None

    def per_s(self, value: float) -> float:
        return value / self.seconds if self.seconds > 0 else 0.0

    @property
    def device_mib_s(self) -> float:
        return self.per_s(self.device_bytes) / MiB

    @property
    def writes_per_s(self) -> float:
        return self.per_s(self.writes)

    @property
    def average_write(self) -> float:
        return self.device_bytes / self.writes if self.writes else 0.0

    def latency_ms(self, quantile: float) -> float:
        given = self.p50_s if quantile == P50 else self.p99_s
        if given is not None:
            return given * MS_PER_S
        return quantile_ms(self.latencies, quantile)


# --- the WAL ---------------------------------------------------------------------------------


def _zero_header(path: Path) -> None:
    """Forget the ring on ``path``: the next WAL opens it as new."""
    raw = open_raw(path, writable=True)
    buffer = aligned_buffer(HEADER_AREA)
    try:
        with memoryview(buffer) as whole, whole[:HEADER_AREA] as zeros:
            write_exactly(raw, zeros, 0)
        os.fsync(raw.fd)
    finally:
        buffer.close()
        raw.close()


async def _wal_run(
    settings: Settings,
    name: str,
    size: int,
    seconds: float,
    warmup: float,
    writers: int,
    rate: float | None,
) -> Row:
    """Appends of ``size``-byte payloads for ``warmup`` + ``seconds``: closed loop with
    ``writers`` appenders, or open loop at ``rate`` appends/s. Trims on the ring's request."""
    wanted = asyncio.Event()
    wal = BlockWal(settings, SystemClock(), Faults(), request_checkpoint=wanted.set)
    mark = await asyncio.to_thread(wal.last_mark)
    await asyncio.to_thread(lambda: sum(1 for _ in wal.recover(mark)))
    await wal.start()
    payload = bytes([PAYLOAD_FILL]) * size
    crc = record_crc(BENCH_LEDGER, 0, payload)
    append = wal.append
    clock = time.perf_counter
    latencies: list[float] = []
    phase = Phase()

    async def trimmer() -> None:
        while phase.running:
            await wanted.wait()
            wanted.clear()
            if phase.running:
                at = await wal.checkpoint_point()
                await asyncio.to_thread(wal.checkpoint_complete, at)

    async def appender() -> None:
        record = latencies.append
        while phase.running:
            started = clock()
            await append(BENCH_LEDGER, 0, crc, payload)
            if phase.recording:
                record(clock() - started)

    async def generator(per_s: float) -> None:
        record = latencies.append
        begun = clock()
        issued = 0

        def done(started: float) -> Callable[[asyncio.Future[Any]], None]:
            def finish(_: asyncio.Future[Any]) -> None:
                if phase.recording:
                    record(clock() - started)

            return finish

        while phase.running:
            due = int((clock() - begun) * per_s)
            while issued < due:
                issued += 1
                append(BENCH_LEDGER, 0, crc, payload).add_done_callback(done(clock()))
            await asyncio.sleep(OPEN_LOOP_TICK_S)

    tasks = [asyncio.create_task(trimmer())]
    if rate is None:
        tasks += [asyncio.create_task(appender()) for _ in range(writers)]
    else:
        tasks.append(asyncio.create_task(generator(rate)))
    try:
        await asyncio.sleep(warmup)
        blocks0, bytes0, records0 = wal.blocks_written, wal.bytes_written, wal.records_written
        elapsed = await phase.record(seconds)
        blocks = wal.blocks_written - blocks0
        device_bytes = wal.bytes_written - bytes0
        appends = wal.records_written - records0
    finally:
        phase.running = False
        wanted.set()
        await asyncio.sleep(0)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await wal.close()
    return Row(name, size, appends, appends * size, blocks, device_bytes, elapsed, latencies)


def _wal_settings(scratch: Path, medium: Path, **overrides: Any) -> Settings:
    return load(
        data_dir=scratch / "data",
        wal_kind="blockdev",
        wal_path=medium,
        wal_capacity=RING_CAPACITY,
        max_entry_size=1 * MiB,
        **overrides,
    )


def _measure_wal(
    scratch: Path,
    medium: Path,
    name: str,
    size: int,
    seconds: float,
    warmup: float,
    writers: int,
    rate: float | None,
    **overrides: Any,
) -> Row:
    _zero_header(medium)
    settings = _wal_settings(scratch, medium, **overrides)
    tune()  # as `serve` does
    return run(_wal_run(settings, name, size, seconds, warmup, writers, rate))


# --- fio -------------------------------------------------------------------------------------


def _fio(
    medium: Path, block: int, depth: int, seconds: float, warmup: float, sync: bool
) -> Row | str:
    """fio's sequential direct writes on ``medium``; a reason string when it cannot run."""
    fio = shutil.which("fio")
    if fio is None:
        return "fio is not installed (apt-get install fio)"
    command = [
        fio,
        "--name=wal-baseline",
        f"--filename={medium}",
        "--rw=write",
        f"--bs={block}",
        f"--iodepth={depth}",
        "--direct=1",
        "--ioengine=libaio",
        f"--size={RING_CAPACITY}",
        f"--runtime={int(seconds * MS_PER_S)}ms",
        f"--ramp_time={int(warmup * MS_PER_S)}ms",
        "--time_based",
        "--output-format=json",
    ]
    if sync:
        command.append("--sync=dsync")
    try:
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=warmup + seconds + FIO_TIMEOUT_MARGIN_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return "fio did not finish"
    if done.returncode != 0:
        return f"fio failed: {done.stderr.strip()[:300]}"
    try:
        write = json.loads(done.stdout[done.stdout.index("{") :])["jobs"][0]["write"]
    except (ValueError, KeyError, IndexError) as e:
        return f"fio's output is not what was expected: {e}"
    ios = int(write["total_ios"])
    runtime_s = float(write["runtime"]) / MS_PER_S
    percentiles = write["clat_ns"].get("percentile", {})
    label = f"fio bs={block // KiB}k QD{depth}{' dsync' if sync else ' no sync (reference)'}"
    return Row(
        label,
        0,
        0,
        0,
        ios,
        int(write["io_bytes"]),
        runtime_s,
        [],
        p50_s=float(percentiles.get("50.000000", 0)) / 1e9,
        p99_s=float(percentiles.get("99.000000", 0)) / 1e9,
    )


# --- media -----------------------------------------------------------------------------------


class NoLoopDevice(Exception):
    """Why no loop device could be made (no losetup, not root, no /dev/loop-control)."""


@contextlib.contextmanager
def loop_device(backing: Path, size: int) -> Iterator[Path]:
    """A loop device of ``size`` bytes over the new zero-filled file ``backing``, detached
    afterwards; NoLoopDevice says why there is none. The WAL tests use it too."""
    create_file(backing, size)
    try:
        made = subprocess.run(
            ["losetup", "--find", "--show", str(backing)],
            capture_output=True,
            text=True,
            timeout=LOSETUP_TIMEOUT_S,
            check=False,
        )
    except FileNotFoundError:
        raise NoLoopDevice("losetup is not installed (util-linux)") from None
    if made.returncode != 0:
        raise NoLoopDevice(f"losetup failed over {backing} (root is needed): {made.stderr.strip()}")
    device = Path(made.stdout.strip())
    try:
        yield device
    finally:
        subprocess.run(["losetup", "--detach", str(device)], timeout=LOSETUP_TIMEOUT_S, check=False)


# --- report ----------------------------------------------------------------------------------


def _table(rows: list[Row]) -> list[str]:
    header = (
        "run",
        "record B",
        "appends/s",
        "payload MiB/s",
        "writes/s",
        "device MiB/s",
        "avg write KiB",
        "p50 ms",
        "p99 ms",
    )
    cells = [
        (
            r.name,
            f"{r.record_size:,}" if r.record_size else "-",
            f"{r.per_s(r.appends):,.0f}" if r.record_size else "-",
            f"{r.per_s(r.payload_bytes) / MiB:,.1f}" if r.record_size else "-",
            f"{r.writes_per_s:,.0f}",
            f"{r.device_mib_s:,.1f}",
            f"{r.average_write / KiB:,.1f}",
            f"{r.latency_ms(P50):.3f}",
            f"{r.latency_ms(P99):.3f}",
        )
        for r in rows
    ]
    return markdown_table(header, cells)


def _print(lines: list[str]) -> None:
    print("\n".join(lines), flush=True)


def _verdict(ratio: float | None) -> str:
    if ratio is None:
        return "n/a"
    verdict = "meets" if ratio >= TARGET_RATIO else "MISSES"
    return f"{ratio:.2f} ({verdict} the {TARGET_RATIO:.0%} target)"


@dataclass(slots=True)
class MediumSummary:
    name: str
    # The median round's ratios: wal/fio device MiB/s by record size, writes/s at 4 KiB.
    bandwidth: dict[int, float | None] = field(default_factory=dict)
    iops: float | None = None


def _merge(rows: list[Row]) -> Row:
    """Rounds of one run as one row: counts and times summed, latencies pooled (fio's
    percentiles: the median round's)."""
    first = rows[0]
    given = sorted(rows, key=lambda r: r.p50_s or 0.0)[len(rows) // 2]
    return Row(
        first.name,
        first.record_size,
        sum(r.appends for r in rows),
        sum(r.payload_bytes for r in rows),
        sum(r.writes for r in rows),
        sum(r.device_bytes for r in rows),
        sum(r.seconds for r in rows),
        [x for r in rows for x in r.latencies],
        given.p50_s,
        given.p99_s,
    )


@dataclass(slots=True)
class Comparison:
    """The WAL against fio over alternating rounds."""

    wal: Row  # the rounds merged
    fio: Row | str  # merged, or why fio could not run
    ratios: list[float]  # wal/fio of each round
    pooled: float | None  # wal/fio of the merged rows

    @property
    def median(self) -> float | None:
        return statistics.median(self.ratios) if self.ratios else None

    def notes(self, what: str) -> list[str]:
        notes = [
            f"- {what}: median of {len(self.ratios)} rounds {_verdict(self.median)}; "
            f"pooled {_figure(self.pooled)}; by round: {_listed(self.ratios)}"
        ]
        if isinstance(self.fio, str):
            notes.append(f"- fio: {self.fio}")
        return notes


def _against_fio(
    run_wal: Callable[[float], Row],
    figure: Callable[[Row], float],
    medium: Path,
    block: int | None,
    seconds: float,
    warmup: float,
    sync: bool,
    depth: int,
) -> Comparison:
    """The WAL and fio in alternating rounds, compared by ``figure``. ``block`` None: fio
    writes the WAL's average block (of its first run that wrote, which comes first)."""
    wal_rows: list[Row] = []
    fio_rows: list[Row] = []
    ratios: list[float] = []
    reason = ""
    for round_ in range(ROUNDS):
        wal_first = round_ % 2 == 0
        if wal_first:
            wal = run_wal(seconds / ROUNDS)
            wal_rows.append(wal)
        # A short run on a busy machine may write nothing: fio then takes the first that did.
        average = next((r.average_write for r in wal_rows if r.average_write), 0.0)
        while block is None and not average and len(wal_rows) < ROUNDS:
            wal = run_wal(seconds / ROUNDS)
            wal_rows.append(wal)
            average = wal.average_write
        size = block or max(BLOCK_ALIGNMENT, round(average / BLOCK_ALIGNMENT) * BLOCK_ALIGNMENT)
        fio = _fio(medium, size, depth, seconds / ROUNDS, warmup, sync)
        if not wal_first:
            wal = run_wal(seconds / ROUNDS)
            wal_rows.append(wal)
        if isinstance(fio, str):
            reason = fio
            continue
        fio_rows.append(fio)
        ratio = _ratio_of(figure(wal), figure(fio))
        if ratio is not None:
            ratios.append(ratio)
    merged = _merge(wal_rows)
    if not fio_rows:
        return Comparison(merged, reason, ratios, None)
    fio_merged = _merge(fio_rows)
    return Comparison(merged, fio_merged, ratios, _ratio_of(figure(merged), figure(fio_merged)))


def _device_mib_s(row: Row) -> float:
    return row.device_mib_s


def _writes_per_s(row: Row) -> float:
    return row.writes_per_s


def _bench_medium(
    scratch: Path,
    medium: Path,
    title: str,
    sizes: list[int],
    seconds: float,
    warmup: float,
    writers: int,
) -> MediumSummary:
    defaults = _wal_settings(scratch, medium)
    depth = defaults.wal_io_depth
    sync = defaults.wal_volatile_write_cache
    summary = MediumSummary(title)
    _print(["", f"### {title}", ""])
    for size in sizes:

        def unthrottled(run_s: float, size: int = size) -> Row:
            return _measure_wal(
                scratch,
                medium,
                "wal unthrottled",
                size,
                run_s,
                warmup,
                writers,
                None,
                wal_write_rate_limit=0,
            )

        bandwidth = _against_fio(
            unthrottled, _device_mib_s, medium, None, seconds, warmup, sync, depth
        )
        target = min(float(GP3_IOPS), GP3_BYTES_PER_S / size)
        paced = _measure_wal(
            scratch,
            medium,
            f"wal at target ({target:,.0f}/s)",
            size,
            seconds,
            warmup,
            writers,
            target,
        )
        fio = bandwidth.fio
        rows = [bandwidth.wal, paced] + ([fio] if isinstance(fio, Row) else [])
        summary.bandwidth[size] = bandwidth.median
        block = round(fio.average_write) if isinstance(fio, Row) else 0
        notes = bandwidth.notes(
            f"wal/fio bandwidth (device MiB/s, same {block // KiB} KiB writes, QD{depth})"
        )
        _print(["", f"#### records of {size:,} B", "", *_table(rows), "", *notes])

    def four_kib(run_s: float) -> Row:
        return _measure_wal(
            scratch,
            medium,
            "wal 4 KiB blocks",
            IOPS_BLOCK - RECORD_OVERHEAD,
            run_s,
            warmup,
            writers,
            None,
            wal_write_rate_limit=0,
            wal_block_soft_limit=IOPS_BLOCK,
        )

    iops = _against_fio(four_kib, _writes_per_s, medium, IOPS_BLOCK, seconds, warmup, sync, depth)
    fio_raw = _fio(medium, IOPS_BLOCK, depth, seconds, warmup, False) if sync else None
    rows = [iops.wal] + [r for r in (iops.fio, fio_raw) if isinstance(r, Row)]
    summary.iops = iops.median
    notes = iops.notes(f"wal/fio writes/s at 4 KiB blocks, QD{depth}")
    _print(["", "#### IOPS: 4 KiB blocks", "", *_table(rows), "", *notes])
    return summary


def _listed(ratios: list[float]) -> str:
    return ", ".join(f"{r:.2f}" for r in ratios) if ratios else "n/a"


def _ratio_of(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def _figure(ratio: float | None) -> str:
    return f"{ratio:.2f}" if ratio is not None else "n/a"


def main(args: argparse.Namespace) -> int:
    writers, seconds = int(args.writers), float(args.seconds)
    require_positive(writers=writers, seconds=seconds)
    sizes = parse_sizes("--record-sizes", str(args.record_sizes), MiB)
    warmup = warmup_for(seconds)
    with scratch_dir(args.dir, "node-bench-wal-") as scratch:
        defaults = _wal_settings(scratch, scratch / "ring")
        _print(
            [
                f"## node bench wal: {writers} appenders (unthrottled runs), {seconds:g} s per "
                f"run after {warmup:g} s warm-up",
                "",
                machine_line(scratch),
                f"- wal: ring {RING_CAPACITY // MiB} MiB, wal_io_depth={defaults.wal_io_depth}, "
                f"wal_block_soft_limit={defaults.wal_block_soft_limit // KiB} KiB, "
                f"wal_write_rate_limit={defaults.wal_write_rate_limit} (0 in unthrottled runs), "
                f"wal_volatile_write_cache={defaults.wal_volatile_write_cache}, "
                f"wal_sync_mode={defaults.wal_sync_mode} (durable before acknowledging; fio "
                "gets sync=dsync)",
            ]
        )
        summaries = []
        if args.path is not None:
            path = Path(args.path).resolve()
            if not path.exists():
                create_file(path, RING_CAPACITY)
            raw = open_raw(path, writable=False)
            size = raw.size
            raw.close()
            if size < RING_CAPACITY:
                raise UsageError(f"{path} holds {size} bytes, less than {RING_CAPACITY}")
            summaries.append(
                _bench_medium(scratch, path, f"{path}", sizes, seconds, warmup, writers)
            )
        else:
            try:
                with loop_device(scratch / "loop.img", RING_CAPACITY) as device:
                    title = f"loop device {device} over {scratch / 'loop.img'}"
                    summaries.append(
                        _bench_medium(scratch, device, title, sizes, seconds, warmup, writers)
                    )
            except NoLoopDevice as e:
                _print(["", f"### loop device: not measured: {e}"])
            ring_file = scratch / "wal.ring"
            create_file(ring_file, RING_CAPACITY)
            summaries.append(
                _bench_medium(
                    scratch, ring_file, f"file {ring_file}", sizes, seconds, warmup, writers
                )
            )
        _print_summary(summaries, sizes)
    return 0


def _print_summary(summaries: list[MediumSummary], sizes: list[int]) -> None:
    header = ("medium", *(f"{s // KiB} KiB bw wal/fio" for s in sizes), "4 KiB IOPS wal/fio")
    rows = [
        (m.name, *(_figure(m.bandwidth.get(s)) for s in sizes), _figure(m.iops)) for m in summaries
    ]
    _print(
        [
            "",
            "### summary: median wal/fio of the rounds (targets: >= 0.80 at 256 KiB and at 4 KiB "
            "IOPS)",
            "",
            *markdown_table(header, rows),
        ]
    )
