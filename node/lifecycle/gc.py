"""Garbage collection of entry logs (BookKeeper's GarbageCollectorThread), on the storage's
public API.

A run: finish or undo interrupted compactions; when asked for (over HTTP, by the disk
monitor), checkpoint so that recent deletions are durable; forget deleted ledgers (index
entries and metadata); learn each sealed log's ledgers (its ledgers map, or a scan paced in
bytes/s whose result is kept beside the log) and keep that in memory; delete logs that hold
no live ledger; then major compaction (usage below 0.8, every 24 h) or else minor (below
0.2, every hour), emptiest logs first, within a time bound and a throttle that counts reads
as well as writes (reads in bytes/s of their own when it counts entries).

Usage is live bytes over the larger of the log's size and ``log_size_limit``, so small
logs (compaction outputs, logs of a short-lived node) get merged instead of lingering once
they hold dead data. A log without dead data is never a candidate: its copy frees nothing.

Two triggers beyond BookKeeper's intervals bound what the intervals alone let through:

- space: when the sealed logs take more than ``compaction_space_amplification_limit`` times
  their live bytes, the next run compacts the emptiest logs until they would not (RocksDB's
  size-amplification trigger). Without it a daily major leaves the disk at 1/0.8 of the live
  bytes, and the logs that drop below 0.8 during the day wait for the next one: 1.66x seen in
  the 30-day simulation.
- lag: a log that has held dead data for a major interval is compacted whatever its usage
  (Kafka's max.compaction.lag.ms, KIP-354). When GC first saw the dead data is kept in
  ``gc-state.json`` beside the logs, so a restart does not restart the wait.
Above the GC watermark (``gc_disk_usage_threshold``) or on a full disk, compaction runs at
every run whatever the intervals, for the logs whose live bytes fit the free space, into
outputs no larger than it; deleting empty logs always runs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from node.settings import Settings
from node.storage import entrylog, logformat
from node.storage.clock import Clock
from node.storage.compaction import CompactionResult, Throttle
from node.storage.errors import CorruptRecord
from node.storage.fsutil import write_file_atomically
from node.storage.ledgers import LedgerStorage

log = logging.getLogger(__name__)

USAGE_BUCKETS = 10  # BookKeeper's ENTRY_LOG_USAGE_SEGMENT_COUNT
STATE_FILE = "gc-state.json"  # beside the entry logs: when each log first held dead data
STATE_VERSION = 1
REAP_POLL_MIN_S = 0.1  # the shortest wait between checks for retired logs held too long


@dataclass(slots=True)
class LogMeta:
    """What GC knows of one sealed log: bytes per ledger, and the log's size."""

    log_id: int
    ledgers: dict[int, int]
    size: int
    # When GC first saw data of a deleted ledger in it (wall clock, ms): the lag bound.
    dead_since_ms: int | None = None

    def live_bytes(self, is_live: Callable[[int], bool]) -> int:
        return sum(n for lid, n in self.ledgers.items() if is_live(lid))

    def record_bytes(self) -> int:
        return sum(self.ledgers.values())


@dataclass(slots=True)
class GcStats:
    """Counters since start, for metrics."""

    runs: int = 0
    deleted_ledgers: int = 0
    reclaimed_by_deletion_bytes: int = 0
    reclaimed_by_compaction_bytes: int = 0
    compaction_read_bytes: int = 0
    compaction_written_bytes: int = 0
    scanned_bytes: int = 0  # read to learn the ledgers of logs without a map
    last_run_seconds: float = 0.0
    run_seconds_total: float = 0.0
    failures: int = 0  # runs that raised (run_forever logs them and waits for the next)
    last_success_ms: int = 0  # wall clock of the last run that finished; 0: none yet


@dataclass(slots=True)
class GcStatus:
    """BookKeeper's GarbageCollectionStatus, and what BookKeeper's users missed: the log
    being compacted with its progress, the last error per log, logs skipped as unreadable."""

    force_compacting: bool = False
    major_compacting: bool = False
    minor_compacting: bool = False
    last_major_compaction_ms: int = 0
    last_minor_compaction_ms: int = 0
    major_compaction_counter: int = 0
    minor_compaction_counter: int = 0
    space_compaction_counter: int = 0
    major_suspended: bool = False
    minor_suspended: bool = False
    compacting_log: int | None = None
    space_amplification: float = 1.0  # sealed logs over their live bytes, before compacting
    bytes_done: int = 0
    bytes_left: int = 0
    last_errors: dict[int, str] = field(default_factory=dict)
    unreadable_logs: list[int] = field(default_factory=list)

    def as_bookkeeper(self) -> dict[str, object]:
        """The shape of /api/v1/bookie/gc_details (one object per ledger dir), extended."""
        return {
            "forceCompacting": self.force_compacting,
            "majorCompacting": self.major_compacting,
            "minorCompacting": self.minor_compacting,
            "lastMajorCompactionTime": self.last_major_compaction_ms,
            "lastMinorCompactionTime": self.last_minor_compaction_ms,
            "majorCompactionCounter": self.major_compaction_counter,
            "minorCompactionCounter": self.minor_compaction_counter,
            "spaceCompactionCounter": self.space_compaction_counter,
            "spaceAmplification": (
                round(self.space_amplification, 3)
                if math.isfinite(self.space_amplification)
                else None
            ),
            "compactingLog": None if self.compacting_log is None else f"{self.compacting_log:x}",
            "compactingBytesDone": self.bytes_done,
            "compactingBytesLeft": self.bytes_left,
            "lastErrors": {f"{k:x}": v for k, v in sorted(self.last_errors.items())},
            "unreadableLogs": [f"{i:x}" for i in self.unreadable_logs],
        }


@dataclass(slots=True)
class GcReport:
    """What one run did."""

    purged_ledgers: list[int] = field(default_factory=list)
    deleted_logs: list[int] = field(default_factory=list)
    compaction: str | None = None  # "major", "space", "minor" or None
    result: CompactionResult = field(default_factory=CompactionResult)
    recovered: list[str] = field(default_factory=list)


class GarbageCollector:
    def __init__(
        self,
        storage: LedgerStorage,
        clock: Clock,
        sleep: Callable[[float], None] = time.sleep,
        free_bytes: Callable[[Path], int] | None = None,
    ) -> None:
        self._storage = storage
        self._settings: Settings = storage.settings
        self._clock = clock
        self._sleep = sleep
        self._free_bytes = free_bytes or _free_bytes
        self._metas: dict[int, LogMeta] = {}
        self._state_path = self._settings.ledgers_dir / STATE_FILE
        self._saved_state: dict[str, int] | None = None
        self._lock = asyncio.Lock()
        self._wanted = asyncio.Event()
        self._force: tuple[bool, bool] | None = None  # (major, minor) asked for over HTTP
        self._requested = False  # a run was asked for: it makes pending deletions durable
        self._throttles: list[Throttle] = []  # the current run's: stop() cancels them
        self._stopping = False
        self.disk_full = False  # set by the disk monitor
        self.disk_pressure = False  # above the GC watermark (the disk monitor): compact now
        self.stats = GcStats()
        started = clock.now_ms()
        self.status = GcStatus(last_major_compaction_ms=started, last_minor_compaction_ms=started)
        self._last_major = clock.monotonic()
        self._last_minor = clock.monotonic()

    # --- triggers ----------------------------------------------------------------------------

    def request(self, force_major: bool = False, force_minor: bool = False) -> None:
        """Run as soon as possible. A forced compaction overrides the suspensions
        (as BookKeeper's PUT /api/v1/bookie/gc with forceMajor/forceMinor does)."""
        if force_major or force_minor:
            previous = self._force or (False, False)
            self._force = (previous[0] or force_major, previous[1] or force_minor)
        self._requested = True
        self.status.force_compacting = True
        self._wanted.set()

    @property
    def in_force_gc(self) -> bool:
        return self.status.force_compacting

    def suspend(self, major: bool, minor: bool) -> None:
        self.status.major_suspended |= major
        self.status.minor_suspended |= minor

    def resume(self, major: bool, minor: bool) -> None:
        self.status.major_suspended &= not major
        self.status.minor_suspended &= not minor

    async def run_forever(self) -> None:
        """A run every ``gc_wait_time_ms`` and whenever one is requested. In between, while a
        retired log is still held by a read, it is deleted once held for
        ``destroy_mapped_file_interval_forcibly_ms`` (at most a quarter of that late), not at the
        next run, up to ``gc_wait_time_ms`` later."""
        s = self._settings
        wait_s = s.gc_wait_time_ms / 1000
        reap_every_s = max(s.destroy_mapped_file_interval_forcibly_ms / 1000 / 4, REAP_POLL_MIN_S)
        next_run = self._clock.monotonic() + wait_s
        while True:
            timeout = next_run - self._clock.monotonic()
            if self._storage.retired_logs:
                timeout = min(timeout, reap_every_s)
            await self._clock.wait(self._wanted, max(timeout, 0.0))
            if self._stopping:
                return
            if not self._wanted.is_set() and self._clock.monotonic() < next_run:
                await asyncio.to_thread(self._storage.reap_retired_logs)
                continue
            self._wanted.clear()
            try:
                await self.run()
            except Exception:
                log.exception("garbage collection failed; retrying at the next run")
            next_run = self._clock.monotonic() + wait_s

    def stop(self) -> None:
        """Ask the loop to end; a compaction in progress stops after its current log
        (awaiting run_forever then waits for that, never leaving work half-way)."""
        self._stopping = True
        for throttle in self._throttles:
            throttle.cancelled = True
        self._wanted.set()

    # --- a run -------------------------------------------------------------------------------

    async def run(self) -> GcReport:
        async with self._lock:
            started = self._clock.monotonic()
            force = self._force
            self._force = None
            requested, self._requested = self._requested, False
            report = GcReport()
            succeeded = False
            try:
                report.recovered = await asyncio.to_thread(self._storage.compactor.recover)
                if requested:
                    await self._make_deletions_durable()
                report.purged_ledgers = await self._storage.purge_deleted_ledgers()
                self.stats.deleted_ledgers += len(report.purged_ledgers)
                await asyncio.to_thread(self._collect_and_compact, report, force)
                succeeded = True
            finally:
                # A request that came in during this run is still to be served.
                self.status.force_compacting = self._requested
                self.status.compacting_log = None
                elapsed = self._clock.monotonic() - started
                self.stats.runs += 1
                self.stats.last_run_seconds = elapsed
                self.stats.run_seconds_total += elapsed
                # Alerts need both: a GC that raises every run, and one that stopped running.
                if succeeded:
                    self.stats.last_success_ms = self._clock.now_ms()
                else:
                    self.stats.failures += 1
            return report

    async def _make_deletions_durable(self) -> None:
        """A checkpoint, so that ledgers deleted since the last one can be purged by this
        run: whoever asks for a run (an operator after deleting, a filling disk) wants the
        space back now, not after the next checkpoint interval. Without it the run goes on
        with the deletions that are durable already."""
        try:
            await self._storage.checkpoint(force=True)
        except Exception as e:  # no space, a failed index write: logged, not fatal here
            log.warning(
                "garbage collection goes on without a checkpoint (%s): ledgers deleted "
                "since the last checkpoint are reclaimed by a later run",
                e,
            )

    def _collect_and_compact(self, report: GcReport, force: tuple[bool, bool] | None) -> None:
        """Blocking, on a worker thread."""
        self._storage.reap_retired_logs()
        s = self._settings
        reads = self._new_throttle(s.gc_read_rate_by_bytes, by_bytes=True)
        rate = (
            s.compaction_rate_by_bytes if s.is_throttle_by_bytes else s.compaction_rate_by_entries
        )
        throttle = self._new_throttle(rate, s.is_throttle_by_bytes)
        self._throttles = [reads, throttle]
        self._refresh_metas(reads)
        is_live = self._storage.is_live_ledger
        now_ms = self._clock.now_ms()
        for log_id, meta in list(self._metas.items()):
            live = meta.live_bytes(is_live)
            if live == 0:
                self._storage.retire_log(log_id)
                del self._metas[log_id]
                report.deleted_logs.append(log_id)
                self.stats.reclaimed_by_deletion_bytes += meta.size
            elif meta.dead_since_ms is None and live < meta.record_bytes():
                meta.dead_since_ms = now_ms
        if report.deleted_logs:
            log.info("deleted %d entry logs with no live ledger", len(report.deleted_logs))
        self.status.space_amplification = self.space_amplification()
        kind = self._compaction_due(force)
        if kind is not None:
            report.compaction = kind
            # Counting bytes, compaction's reads share its rate (as documented); counting
            # entries, they are paced in bytes with the scans.
            self._compact(kind, throttle, None if s.is_throttle_by_bytes else reads, report)
        self._save_state()

    def _compact(
        self, kind: str, throttle: Throttle, reads: Throttle | None, report: GcReport
    ) -> None:
        s = self._settings
        max_ms = (
            s.minor_compaction_max_time_ms if kind == "minor"
            else s.major_compaction_max_time_ms
        )  # fmt: skip
        candidates = self._candidates(kind)
        if not candidates:
            # Nothing would be freed: no new log, no I/O. The run still counts as this
            # kind's run for the intervals and counters, as BookKeeper's does.
            self._finish_compaction(kind, CompactionResult(), report)
            return
        deadline = self._clock.monotonic() + max_ms / 1000 if max_ms > 0 else None
        flag = "minor_compacting" if kind == "minor" else "major_compacting"
        setattr(self.status, flag, True)
        try:
            result = self._storage.compactor.compact(
                candidates, self._storage.is_live_ledger, throttle, self._progress, deadline,
                self._clock.monotonic, self._output_limit(), reads,
            )  # fmt: skip
        finally:
            setattr(self.status, flag, False)
        self._finish_compaction(kind, result, report)

    def _finish_compaction(self, kind: str, result: CompactionResult, report: GcReport) -> None:
        report.result = result
        for source in result.compacted:
            self._metas.pop(source, None)
            self.status.last_errors.pop(source, None)
        self.status.last_errors.update(result.failed)
        self.stats.reclaimed_by_compaction_bytes += result.reclaimed_bytes
        self.stats.compaction_read_bytes += result.bytes_read
        self.stats.compaction_written_bytes += result.bytes_written
        now_ms, now = self._clock.now_ms(), self._clock.monotonic()
        st = self.status
        # A major covers a minor (as BookKeeper), and so does a space run: it takes every
        # log below the minor threshold first.
        if kind == "major":
            self._last_major = now
            st.last_major_compaction_ms = now_ms
            st.major_compaction_counter += 1
        elif kind == "space":
            st.space_compaction_counter += 1
        else:
            st.minor_compaction_counter += 1
        self._last_minor = now
        st.last_minor_compaction_ms = now_ms
        if result.compacted:
            log.info(
                "%s compaction: %d logs into %d, %d bytes reclaimed (%d read, %d written)",
                kind, len(result.compacted), len(result.output_logs), result.reclaimed_bytes,
                result.bytes_read, result.bytes_written,
            )  # fmt: skip

    def _new_throttle(self, rate: float, by_bytes: bool) -> Throttle:
        throttle = Throttle(rate, by_bytes, self._clock.monotonic, self._sleep)
        throttle.cancelled = self._stopping
        return throttle

    def _refresh_metas(self, reads: Throttle) -> None:
        """Learn the ledgers of logs not seen yet. A log left without its ledgers map (the
        checkpoint's log when the node died) is read whole, paced by bytes: compaction's
        throttle counts entries by default (1000/s, BookKeeper's), which made a 1 GB log of
        1 KiB entries take 17 minutes before a run after a crash could reclaim anything.
        What the read learns is kept beside the log, so it is read once, not at every start."""
        entrylog.delete_orphan_map_files(self._settings.ledgers_dir)
        candidates = set(self._storage.gc_candidate_logs())
        for gone in set(self._metas) - candidates:
            del self._metas[gone]
        dead_since: dict[int, int] = {}
        if self._saved_state is None:  # the first run: take over what the last process saw
            dead_since = self._load_state()
            self._saved_state = {f"{k:x}": v for k, v in dead_since.items()}
        unreadable = []

        def on_read(records: int, size: int) -> None:
            self.stats.scanned_bytes += size
            reads.acquire(records, size)

        for log_id in sorted(candidates - set(self._metas)):
            path = logformat.log_path(self._settings.ledgers_dir, log_id)
            try:
                sizes = entrylog.ledger_sizes(path, on_read, keep=True)
                size = path.stat().st_size
            except (CorruptRecord, OSError) as e:
                # BookKeeper's users saw GC stop silently here: report the log, go on.
                unreadable.append(log_id)
                self.status.last_errors[log_id] = str(e)
                log.error("garbage collection skips unreadable entry log %x: %s", log_id, e)
                continue
            self._metas[log_id] = LogMeta(log_id, sizes, size, dead_since.get(log_id))
        self.status.unreadable_logs = unreadable

    # --- the lag bound's state ---------------------------------------------------------------

    def _load_state(self) -> dict[int, int]:
        """When each log was first seen holding dead data, as the last run saved it. A lost or
        unreadable file only restarts the waits, as a node without it would."""
        try:
            state = json.loads(self._state_path.read_bytes())
            return {int(k, 16): int(v) for k, v in state["dead_since_ms"].items()}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            log.warning("ignoring unreadable %s: %s", self._state_path, e)
            return {}

    def _save_state(self) -> None:
        """Written only when it changed: a run usually changes nothing."""
        dead_since = {
            f"{m.log_id:x}": m.dead_since_ms
            for m in self._metas.values()
            if m.dead_since_ms is not None
        }
        if dead_since == self._saved_state:
            return
        try:
            data = json.dumps({"version": STATE_VERSION, "dead_since_ms": dead_since}).encode()
            write_file_atomically(self._state_path, data)
            self._saved_state = dead_since
        except OSError as e:  # a full disk: the waits restart after a restart, nothing worse
            log.warning("could not save %s: %s", self._state_path, e)

    # --- what to compact ---------------------------------------------------------------------

    def _compaction_due(self, force: tuple[bool, bool] | None) -> str | None:
        s, st = self._settings, self.status
        now = self._clock.monotonic()
        force_major, force_minor = force or (False, False)
        pressure = self._short_of_space
        major_due = (
            s.major_compaction_interval_s > 0
            and now - self._last_major >= s.major_compaction_interval_s
        )
        minor_due = (
            s.minor_compaction_interval_s > 0
            and now - self._last_minor >= s.minor_compaction_interval_s
        )
        if force_major or ((major_due or pressure) and not st.major_suspended):
            return "major"
        if not st.major_suspended and self._over_space_limit():
            return "space"
        if force_minor or ((minor_due or pressure) and not st.minor_suspended):
            return "minor"
        return None

    def _over_space_limit(self) -> bool:
        limit = self._settings.compaction_space_amplification_limit
        if limit <= 0 or self.status.space_amplification <= limit:
            return False
        # Headers and maps count too: many tiny live logs (a node restarted often) exceed a
        # limit without a dead byte, and a run with nothing to copy would fire every time.
        is_live = self._storage.is_live_ledger
        return any(m.live_bytes(is_live) < m.record_bytes() for m in self._metas.values())

    @property
    def _short_of_space(self) -> bool:
        """Above the GC watermark, or full: compact what qualifies whatever the intervals
        (BookKeeper forces GC on an almost full disk), in copies that fit the free space."""
        return self.disk_full or self.disk_pressure

    def _output_limit(self) -> int | None:
        """Short of space, outputs no larger than the free space: each is sealed and its
        sources deleted before the next begins, so compaction frees space as it goes."""
        return self._free_bytes(self._settings.ledgers_dir) if self._short_of_space else None

    def _candidates(self, kind: str) -> list[tuple[int, int]]:
        """(log id, live bytes) of the logs to compact, emptiest first: those below the
        kind's usage threshold, and those over the lag bound whatever their usage. A space
        run takes the logs below the minor threshold, then more until the sealed logs would
        be under the amplification limit."""
        s = self._settings
        is_live = self._storage.is_live_ledger
        short = self._short_of_space
        free = self._free_bytes(s.ledgers_dir) if short else 0
        lag_ms = s.major_compaction_interval_s * 1000  # 0: major and the bound are off
        now_ms = self._clock.now_ms()
        ranked = []
        for log_id, meta in self._metas.items():
            live = meta.live_bytes(is_live)
            if live >= meta.record_bytes():
                # No dead record: a copy frees nothing, however low its usage (a small log
                # is measured against the target size, so every major run would copy it).
                continue
            if short and live >= free:
                continue  # its copy does not fit (any other frees more than it uses)
            dead = meta.dead_since_ms
            lagging = lag_ms > 0 and dead is not None and now_ms - dead >= lag_ms
            usage = live / max(meta.size, s.log_size_limit)
            ranked.append((usage, log_id, live, meta.size, lagging))
        ranked.sort()
        if kind == "space":
            size = sum(m.size for m in self._metas.values())
            live_total = sum(m.live_bytes(is_live) for m in self._metas.values())
            room = size - s.compaction_space_amplification_limit * live_total
            chosen = []
            for usage, log_id, live, log_size, lagging in ranked:
                if room > 0 or usage < s.minor_compaction_threshold or lagging:
                    chosen.append((log_id, live))
                    room -= log_size - live
            return chosen
        threshold = (
            s.major_compaction_threshold if kind == "major" else s.minor_compaction_threshold
        )
        return [
            (log_id, live)
            for usage, log_id, live, _size, lagging in ranked
            if usage < threshold or lagging
        ]

    def _progress(self, log_id: int, done: int, left: int) -> None:
        self.status.compacting_log, self.status.bytes_done, self.status.bytes_left = (
            log_id,
            done,
            left,
        )

    # --- introspection -----------------------------------------------------------------------

    def space_amplification(self) -> float:
        """Bytes of the sealed logs over their live bytes, as of the last run (1.0 when
        there are none; infinite if none of it is live)."""
        is_live = self._storage.is_live_ledger
        metas = list(self._metas.values())
        size = sum(m.size for m in metas)
        live = sum(m.live_bytes(is_live) for m in metas)
        return size / live if live else (float("inf") if size else 1.0)

    def oldest_log_pinning(self, limit: int) -> tuple[int, list[tuple[int, int]]]:
        """The oldest known log (lowest id: ids grow) and its live ledgers with their bytes,
        largest first, at most ``limit``: what keeps it from being deleted or compacted."""
        metas = list(self._metas.values())
        if not metas:
            return 0, []
        oldest = min(metas, key=lambda m: m.log_id)
        is_live = self._storage.is_live_ledger
        live = [(lid, n) for lid, n in oldest.ledgers.items() if is_live(lid)]
        live.sort(key=lambda item: (-item[1], item[0]))
        return len(live), live[:limit]

    def known_logs(self) -> int:
        """Sealed logs measured at the last run (0 before the first)."""
        return len(self._metas)

    def usages(self) -> list[float]:
        """Usage of every known log (live bytes over the larger of size and target)."""
        is_live = self._storage.is_live_ledger
        target = self._settings.log_size_limit
        return [m.live_bytes(is_live) / max(m.size, target) for m in list(self._metas.values())]


def _free_bytes(path: Path) -> int:
    while not path.exists() and path != path.parent:  # a node before its first checkpoint
        path = path.parent
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize
