"""``python -m node bench gc``: what compaction costs, and what it costs the writers.

The data set (in a fresh subdirectory of ``--dir``, or of a temporary directory): LEDGERS
ledgers written round-robin with a checkpoint per round, so that every entry log holds a
slice of each; then all but one in LIVE_EVERY are deleted and a GC run forgets them (no
compaction yet): every log is about 1/LIVE_EVERY live, a major compaction candidate. The
data set is sized so that the throttled compaction below outlasts the measured window.
It is built once and copied for each run, so every run starts from the same logs.

Runs:

1. **compaction alone**, unthrottled: the major compaction of every candidate, MB/s read
   and written (bytes of records, as the throttle counts them).
2. **writes without compaction**: ``--writers`` writers, each with its own ledger and
   ``--window`` adds of 1 KiB in flight (as ``bench write``), for ``--seconds`` after a
   warm-up: adds/s, p50 and p99 add latency.
3. **writes with throttled compaction**: the same load while the same major compaction runs
   on a worker thread (as GC runs it), throttled by the settings (``is_throttle_by_bytes``
   and ``compaction_rate_by_bytes``, BENCH_RATE_BYTES unless NODE_* variables say
   otherwise): the same figures, the ratio p99(with)/p99(without) against the target
   (P99_TARGET), and the compaction I/O measured in the window against the configured rate.

Runs 2 and 3 alternate in rounds of about ROUND_S on the same node (``--seconds`` split
between the rounds; each round of run 3 compacts its share of the logs), and the latencies
of a run's rounds are pooled: the disk and the scheduler drift over time, and alternating
spreads the drift over both sides instead of charging it to one.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node.bench.common import (
    MB,
    P50,
    P99,
    PAYLOAD_FILL,
    AddLoad,
    Result,
    machine_line,
    markdown_table,
    require_positive,
    scratch_dir,
    warmup_for,
)
from node.lifecycle.gc import GarbageCollector
from node.runtime import run, tune
from node.settings import KiB, MiB, Settings, load
from node.storage import entrylog, logformat
from node.storage.clock import SystemClock
from node.storage.compaction import CompactionResult, Throttle
from node.storage.ledgers import LedgerStorage

ENTRY_SIZE = 1 * KiB  # the load's adds, as bench write's default
DATA_ENTRY_SIZE = 1 * KiB  # entries of the data set: compaction's per-record cost shows
LEDGERS = 64  # ledgers of the data set
ROUND_ENTRIES = 64  # entries per ledger per round: a round is LEDGERS x 64 KiB
LIVE_EVERY = 4  # one ledger in 4 survives: logs about 25% live
LOG_SIZE = 4 * MiB  # entry logs of the data set: several logs, several compaction outputs
MIN_DATASET = 48 * MiB  # enough for the unthrottled run to last long enough to measure
DATASET_MARGIN = 1.5  # the throttled compaction outlasts warm-up + window by this factor
BENCH_RATE_BYTES = 4 * MB  # compaction_rate_by_bytes unless the environment sets it
P99_TARGET = 1.2  # target: p99 with throttled compaction within 1.2x of p99 without
ROUND_S = 0.5  # recorded window of one round of run 2 or 3 ...
MIN_ROUNDS = 2  # ... but at least this many rounds each
RATE_ENV = "NODE_COMPACTION_RATE_BY_BYTES"
BY_BYTES_ENV = "NODE_IS_THROTTLE_BY_BYTES"

ALONE = "compaction alone (unthrottled)"
WITHOUT = "writes without compaction"
WITH = "writes with throttled compaction"


class MeteredThrottle(Throttle):
    """Counts what compaction reads and writes (as the throttle sees it); paces it only
    when ``paced``. Counters are read from another thread: ints, so a read is atomic."""

    def __init__(self, rate: float, by_bytes: bool, paced: bool) -> None:
        super().__init__(rate, by_bytes)
        self.by_bytes = by_bytes
        self.paced = paced
        self.entries = 0
        self.bytes = 0

    @property
    def units(self) -> int:
        """What the rate counts: bytes or entries."""
        return self.bytes if self.by_bytes else self.entries

    def acquire(self, entries: int, size_bytes: int) -> None:
        self.entries += entries
        self.bytes += size_bytes
        if self.paced:
            super().acquire(entries, size_bytes)


@dataclass(slots=True)
class Dataset:
    ledgers: int
    deleted: int
    logs: int
    bytes: int
    live_fraction: float


@dataclass(slots=True)
class CompactionFigures:
    logs: int
    result: CompactionResult
    seconds: float

    def mb_s(self, size: int) -> float:
        return size / self.seconds / MB if self.seconds > 0 else 0.0


@dataclass(slots=True)
class LoadFigures:
    result: Result
    compaction_units_per_s: float = 0.0  # bytes or entries per second, as throttled
    compaction_finished_early: bool = False  # it did not run through the whole window


# --- the data set ---------------------------------------------------------------------------


def _settings(data_dir: Path) -> Settings:
    overrides: dict[str, Any] = {
        "data_dir": data_dir,
        "log_size_limit": LOG_SIZE,
        "max_entry_size": LOG_SIZE // 2,  # a settings rule; the bench's entries are 1 KiB
        # The bench starts the compaction it measures; GC's space trigger would start one
        # while the data set is being built.
        "compaction_space_amplification_limit": 0,
    }
    # The configured rate is the bench's unless the operator's environment names one.
    if RATE_ENV not in os.environ:
        overrides["compaction_rate_by_bytes"] = BENCH_RATE_BYTES
    if BY_BYTES_ENV not in os.environ:
        overrides["is_throttle_by_bytes"] = True
    return load(**overrides)


def _dataset_bytes(settings: Settings, window_s: float) -> int:
    """Enough that the throttled compaction lasts DATASET_MARGIN x ``window_s``: it reads
    every byte and writes the live share. Counting bytes, the throttle counts both;
    counting entries, it counts the copies, and the reads have a rate of their own (the
    slower of the two sets the time)."""
    if settings.is_throttle_by_bytes:
        bytes_per_s = settings.compaction_rate_by_bytes / (1 + 1 / LIVE_EVERY)
    else:
        copies = settings.compaction_rate_by_entries * float(DATA_ENTRY_SIZE) * LIVE_EVERY
        bytes_per_s = min(copies, float(settings.gc_read_rate_by_bytes))
    return max(MIN_DATASET, int(bytes_per_s * window_s * DATASET_MARGIN))


async def _build(settings: Settings, size: int) -> Dataset:
    storage = LedgerStorage(settings)
    await storage.start()
    try:
        ids = [(await storage.create_ledger())[0].ledger_id for _ in range(LEDGERS)]
        payload = bytes([PAYLOAD_FILL]) * DATA_ENTRY_SIZE
        batch = [payload] * ROUND_ENTRIES
        rounds = -(-size // (LEDGERS * ROUND_ENTRIES * DATA_ENTRY_SIZE))
        for _ in range(rounds):
            await asyncio.gather(*(storage.add_entries(lid, batch) for lid in ids))
            await storage.checkpoint()  # every log gets a slice of every ledger
        doomed = [lid for i, lid in enumerate(ids) if i % LIVE_EVERY]
        for lid in doomed:
            await storage.delete_ledger(lid)
        await storage.checkpoint()
        # A GC run that is not due to compact: it forgets the deleted ledgers, learns the
        # logs, and deletes none (each holds live data). Compaction is what is measured.
        report = await GarbageCollector(storage, SystemClock()).run()
        if report.compaction is not None or report.deleted_logs:
            raise RuntimeError(f"the data set is not what the bench expects: {report}")
    finally:
        await storage.close()
    logs = await asyncio.to_thread(entrylog.list_logs, settings.ledgers_dir)
    total = sum(
        logformat.log_path(settings.ledgers_dir, i).stat().st_size for i in logs
    )  # fmt: skip
    return Dataset(LEDGERS, len(doomed), len(logs), total, 1 - len(doomed) / LEDGERS)


def _candidates(storage: LedgerStorage) -> list[tuple[int, int]]:
    """Blocking: (log id, live bytes) of the logs a major compaction takes, emptiest first
    (GC's rule: usage against the larger of the log's size and the target size)."""
    settings = storage.settings
    chosen = []
    for log_id in storage.gc_candidate_logs():
        path = logformat.log_path(settings.ledgers_dir, log_id)
        sizes = entrylog.ledger_sizes(path)
        live = sum(n for lid, n in sizes.items() if storage.is_live_ledger(lid))
        usage = live / max(path.stat().st_size, settings.log_size_limit)
        if usage < settings.major_compaction_threshold:
            chosen.append((usage, log_id, live))
    return [(log_id, live) for _usage, log_id, live in sorted(chosen)]


def _throttle(settings: Settings, paced: bool) -> MeteredThrottle:
    by_bytes = settings.is_throttle_by_bytes
    rate = settings.compaction_rate_by_bytes if by_bytes else settings.compaction_rate_by_entries
    return MeteredThrottle(rate, by_bytes, paced)


def _reads_throttle(settings: Settings) -> Throttle | None:
    """As GC paces compaction's reads: with the copies when counting bytes, else apart."""
    if settings.is_throttle_by_bytes:
        return None
    return Throttle(settings.gc_read_rate_by_bytes, by_bytes=True)


def _rounds(seconds: float) -> tuple[int, float]:
    """(rounds, recorded seconds of each) for ``seconds`` of load each way."""
    rounds = max(MIN_ROUNDS, round(seconds / ROUND_S))
    return rounds, seconds / rounds


# --- run 1: compaction alone ----------------------------------------------------------------


async def _compaction_alone(settings: Settings) -> CompactionFigures:
    storage = LedgerStorage(settings)
    await storage.start()
    try:
        candidates = await asyncio.to_thread(_candidates, storage)
        throttle = _throttle(settings, paced=False)
        started = time.perf_counter()
        result = await asyncio.to_thread(
            storage.compactor.compact, candidates, storage.is_live_ledger, throttle
        )
        elapsed = time.perf_counter() - started
    finally:
        await storage.close()
    return CompactionFigures(len(candidates), result, elapsed)


# --- runs 2 and 3: the write load, without and with compaction -------------------------------


async def _window(load: AddLoad, seconds: float, name: str) -> Result:
    load.take()  # drop what the warm-up left
    elapsed = await load.record(seconds)
    latencies = load.take()
    return Result(name, len(latencies), len(latencies) * ENTRY_SIZE, elapsed, latencies)


async def _loads(
    settings: Settings, writers: int, window: int, seconds: float, warmup: float
) -> tuple[list[LoadFigures], list[LoadFigures], list[CompactionResult]]:
    """Rounds of (run 2, run 3) on one node. The data set's logs are dealt out to the
    rounds of run 3; each round's compaction is cancelled when its window ends."""
    storage = LedgerStorage(settings)
    await storage.start()
    without: list[LoadFigures] = []
    with_: list[LoadFigures] = []
    results: list[CompactionResult] = []
    rounds, round_s = _rounds(seconds)
    try:
        ledgers = [(await storage.create_ledger())[0].ledger_id for _ in range(writers)]
        candidates = await asyncio.to_thread(_candidates, storage)
        load = AddLoad(storage, ledgers, window, bytes([PAYLOAD_FILL]) * ENTRY_SIZE)
        try:
            await asyncio.sleep(warmup)
            for index in range(rounds):
                without.append(LoadFigures(await _window(load, round_s, WITHOUT)))
                # The compaction's share of the data set for this round: as many logs as
                # the round's window needs at the configured rate.
                share = candidates[index::rounds]
                throttle = _throttle(settings, paced=True)
                reads = _reads_throttle(settings)
                compaction = asyncio.ensure_future(
                    asyncio.to_thread(
                        storage.compactor.compact, share, storage.is_live_ledger, throttle,
                        reads=reads,
                    )
                )  # fmt: skip
                await asyncio.sleep(min(warmup, round_s))  # the compaction gets going
                units = throttle.units
                figures = LoadFigures(await _window(load, round_s, WITH))
                figures.compaction_units_per_s = (throttle.units - units) / figures.result.seconds
                figures.compaction_finished_early = compaction.done()
                for paced in (throttle, reads):  # the rest of the log in hand runs unpaced
                    if paced is not None:
                        paced.cancelled = True
                results.append(await compaction)
                with_.append(figures)
        finally:
            await load.stop()
    finally:
        await storage.close()
    return without, with_, results


# --- report ---------------------------------------------------------------------------------


def _pooled(rows: list[LoadFigures], name: str) -> Result:
    """All rounds' latencies together, over all rounds' time."""
    latencies = sorted(x for row in rows for x in row.result.latencies)
    seconds = sum(row.result.seconds for row in rows)
    return Result(name, len(latencies), len(latencies) * ENTRY_SIZE, seconds, latencies)


def _ratio(loaded: Result, base: Result) -> float:
    """p99 of ``loaded`` over p99 of ``base`` (both sorted here)."""
    loaded.sort_latencies()
    base.sort_latencies()
    return loaded.latency_ms(P99) / base.latency_ms(P99) if base.latency_ms(P99) else 0.0


def _report(
    settings: Settings,
    alone: CompactionFigures,
    without: list[LoadFigures],
    with_: list[LoadFigures],
    results: list[CompactionResult],
) -> list[str]:
    by_bytes = settings.is_throttle_by_bytes
    unit = "MB/s" if by_bytes else "entries/s"
    scale = MB if by_bytes else 1.0
    rate = settings.compaction_rate_by_bytes if by_bytes else settings.compaction_rate_by_entries
    r = alone.result
    out = [
        "",
        "### compaction alone (unthrottled)",
        "",
        *markdown_table(
            ("run", "logs", "read MB", "written MB", "seconds", "read MB/s", "written MB/s"),
            [
                (
                    ALONE,
                    str(alone.logs),
                    f"{r.bytes_read / MB:,.1f}",
                    f"{r.bytes_written / MB:,.1f}",
                    f"{alone.seconds:.2f}",
                    f"{alone.mb_s(r.bytes_read):,.1f}",
                    f"{alone.mb_s(r.bytes_written):,.1f}",
                )
            ],
        ),
    ]
    base, loaded = _pooled(without, WITHOUT), _pooled(with_, WITH)
    running = [f for f in with_ if not f.compaction_finished_early]
    seconds = sum(f.result.seconds for f in running)
    units = sum(f.compaction_units_per_s * f.result.seconds for f in running)
    measured = units / seconds if seconds else 0.0
    rows: list[tuple[str, ...]] = []
    for row, compaction in ((base, "-"), (loaded, f"{measured / scale:,.2f}")):
        rows.append(
            (
                row.name,
                f"{row.entries_per_s:,.0f}",
                f"{row.latency_ms(P50):.2f}",
                f"{row.latency_ms(P99):.2f}",
                compaction,
            )
        )
    ratio = _ratio(loaded, base)
    verdict = "met" if 0 < ratio <= P99_TARGET else "MISSED"
    per_round = sorted(_ratio(w.result, wo.result) for wo, w in zip(without, with_, strict=True))
    read = sum(c.bytes_read for c in results)
    written = sum(c.bytes_written for c in results)
    out += [
        "",
        f"### writes: {ENTRY_SIZE:,} B adds, {len(without)} alternating rounds of each "
        f"({base.seconds:.2f} s each way)",
        "",
        *markdown_table(("run", "adds/s", "p50 ms", "p99 ms", f"compaction {unit}"), rows),
        "",
        f"- p99 with throttled compaction / without: {ratio:.2f}x "
        f"(target <= {P99_TARGET}x: {verdict}); round by round: min "
        f"{per_round[0]:.2f}x, median {statistics.median(per_round):.2f}x, max "
        f"{per_round[-1]:.2f}x (the spread is this machine's noise)",
        f"- compaction I/O during the windows: {measured / scale:,.2f} {unit} "
        f"({'read + written' if by_bytes else 'copied'}) "
        f"against the configured {rate / scale:,.2f} {unit} ({measured / rate:.0%} of it)"
        + (
            f"; {len(with_) - len(running)} rounds left out: their compaction ended early"
            if len(running) < len(with_)
            else ""
        ),
        f"- the throttled compactions read {read / MB:,.1f} MB and wrote {written / MB:,.1f} MB "
        f"in all, {sum(len(c.compacted) for c in results)} logs into "
        f"{sum(len(c.output_logs) for c in results)}",
    ]
    return out


# --- driver ---------------------------------------------------------------------------------


def main(args: argparse.Namespace) -> int:
    writers, window, seconds = int(args.writers), int(args.window), float(args.seconds)
    require_positive(writers=writers, window=window, seconds=seconds)
    with scratch_dir(args.dir, "node-bench-gc-") as scratch:
        return _run(scratch, writers, window, seconds, warmup_for(seconds))


def _run(scratch: Path, writers: int, window: int, seconds: float, warmup: float) -> int:
    base_dir, alone_dir, load_dir = scratch / "dataset", scratch / "alone", scratch / "load"
    settings = _settings(base_dir)
    rounds, round_s = _rounds(seconds)
    size = _dataset_bytes(settings, (min(warmup, round_s) + round_s) * rounds)
    tune()  # as `serve` does
    dataset = run(_build(settings, size))
    for target in (alone_dir, load_dir):
        shutil.copytree(base_dir, target)  # a closed node's files: an identical node
    shutil.rmtree(base_dir)
    if settings.is_throttle_by_bytes:
        rate_text = f"compaction_rate_by_bytes={settings.compaction_rate_by_bytes / MB:g} MB/s"
        counted = "(reads and writes both count)"
    else:
        rate_text = f"compaction_rate_by_entries={settings.compaction_rate_by_entries:,}/s"
        counted = (
            "(the entries copied; reads at "
            f"gc_read_rate_by_bytes={settings.gc_read_rate_by_bytes / MB:g} MB/s)"
        )
    print(
        "\n".join(
            [
                f"## node bench gc: {writers} writers x {window} adds in flight, "
                f"{seconds:g} s of load each way after {warmup:g} s warm-up",
                "",
                machine_line(scratch),
                f"- data set: {dataset.ledgers} ledgers x {DATA_ENTRY_SIZE:,} B entries "
                f"interleaved over {dataset.logs} entry logs ({dataset.bytes / MB:,.1f} MB, "
                f"log_size_limit={LOG_SIZE // MiB} MiB); {dataset.deleted} ledgers deleted: "
                f"logs {dataset.live_fraction:.0%} live",
                f"- throttle: is_throttle_by_bytes={settings.is_throttle_by_bytes}, "
                f"{rate_text} {counted}; major threshold "
                f"{settings.major_compaction_threshold}",
                "- MB = 10^6 bytes; latency of an add = call to durable acknowledgment; "
                "the sources of run 1 are in the page cache (just written)",
                f"- load average before: {os.getloadavg()[0]:.2f} "
                "(other processes on this machine share its CPUs and disk)",
            ]
        ),
        flush=True,
    )
    alone = run(_compaction_alone(_settings(alone_dir)))
    shutil.rmtree(alone_dir, ignore_errors=True)
    without, with_, results = run(_loads(_settings(load_dir), writers, window, seconds, warmup))
    print("\n".join(_report(settings, alone, without, with_, results)), flush=True)
    print(f"- load average after: {os.getloadavg()[0]:.2f}", flush=True)
    return 0
