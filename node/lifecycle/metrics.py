"""The node's state at scrape time as Prometheus metrics (the collector beside the background
work whose state it reads): a snapshot taken on the event loop when /metrics is scraped (the
engine's caches and counters, ledgers, node state, the raw-device WAL's ring, GC, disks,
retention, offload, streams and cursors: their structures belong to the loop), and the file
system read at render time on a worker thread (entry logs, index size, disks). The metrics
declared up front are node/metrics.py's, on the same registry.

Streams and cursors are named by their operators (as Pulsar labels its topics), and a deleted
stream's series go with it. A node may hold many thousands of streams: only the
``metrics_max_streams`` with the largest backlog have series of their own, and ``streams_*``
aggregates cover all.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from node.audit import kept
from node.lifecycle import BackgroundWork
from node.lifecycle.gc import USAGE_BUCKETS, GcStats
from node.lifecycle.retention import RetentionStats
from node.metrics import MS_PER_S, PREFIX, AuditFigures, Metrics
from node.offload.stats import READ_LATENCY_BUCKETS as OFFLOAD_READ_BUCKETS
from node.offload.stats import OffloadStats
from node.settings import Settings, data_dirs
from node.storage.index import LedgerState
from node.storage.ledgers import LedgerStorage
from node.storage.logformat import SUFFIX as ENTRY_LOG_SUFFIX
from node.storage.probe import Stats
from node.streams.manager import StreamManager
from node.streams.model import Position, Stream

RETENTION_REASONS = ("time", "size", "disk")  # why retention deleted a stream's ledger
# Ledgers named as pinning the oldest entry log: the largest few, so the label stays bounded.
PINNING_LEDGERS_SHOWN = 10


@dataclass(slots=True)
class CursorSnapshot:
    name: str
    mark_delete: Position | None  # as the API shows it (Stream.shown_mark)
    backlog_entries: int
    backlog_bytes: int
    oldest_unacknowledged_age_s: float  # 0 without backlog


@dataclass(slots=True)
class StreamSnapshot:
    name: str
    appended_entries: int
    appended_bytes: int
    rollovers: int
    ledgers: int
    retained_bytes: int
    cursors: list[CursorSnapshot]
    cursor_count: int  # all of the stream's cursors, those without series included
    # Message deduplication (node.streams.dedup), None when the stream has it off: duplicate
    # appends answered, producers tracked, the age of the table's snapshot (-1: none yet).
    dedup: tuple[int, int, float] | None = None

    @property
    def largest_backlog(self) -> int:
        """Entries behind the stream's slowest cursor (0 without cursors)."""
        return max((c.backlog_entries for c in self.cursors), default=0)


@dataclass(slots=True)
class StreamTotals:
    """Over every stream, those without series of their own included."""

    streams: int = 0
    cursors: int = 0
    backlog_entries: int = 0
    backlog_bytes: int = 0
    retained_bytes: int = 0
    oldest_unacknowledged_age_s: float = 0.0  # of any cursor

    def add(self, stream: StreamSnapshot) -> None:
        self.streams += 1
        self.cursors += len(stream.cursors)
        self.retained_bytes += stream.retained_bytes
        for cursor in stream.cursors:
            self.backlog_entries += cursor.backlog_entries
            self.backlog_bytes += cursor.backlog_bytes
            self.oldest_unacknowledged_age_s = max(
                self.oldest_unacknowledged_age_s, cursor.oldest_unacknowledged_age_s
            )


@dataclass(slots=True)
class RingSnapshot:
    ring_bytes: int
    used_bytes: int
    blocks_in_flight: int
    throttled_appends: int
    rejected_appends: int


@dataclass(slots=True)
class EngineSnapshot:
    """What the engine looks like at scrape time, copied on the event loop."""

    engine: Stats = field(default_factory=Stats)
    write_cache_bytes: int = 0
    read_cache_bytes: int = 0
    read_cache_hits: int = 0
    read_cache_misses: int = 0
    journal_queue_bytes: int = 0
    index_keys: int = 0
    long_polls: int = 0
    ledgers_by_state: dict[str, int] = field(default_factory=dict)
    state: str = "writable"
    gc: GcStats = field(default_factory=GcStats)
    compactions: dict[str, int] = field(default_factory=dict)  # by kind
    compacting: dict[str, bool] = field(default_factory=dict)  # by kind
    unreadable_logs: int = 0
    space_amplification: float = 1.0
    log_usages: list[float] = field(default_factory=list)
    disk_warning: bool = False
    reserve_bytes: int = 0  # the emergency reserve held
    streams: list[StreamSnapshot] = field(default_factory=list)  # the largest backlog first
    stream_totals: StreamTotals = field(default_factory=StreamTotals)
    orphan_ledgers: int = 0  # ledgers of streams that no stream names yet hold entries
    # the owner's entry cache of replicated streams (node.streams.cache): hits, misses, bytes
    stream_cache: tuple[int, int, int] = (0, 0, 0)
    retention: RetentionStats = field(default_factory=RetentionStats)
    wal_ring: RingSnapshot | None = None  # with wal_kind=blockdev, once the ring started
    offload: OffloadStats = field(default_factory=OffloadStats)
    offload_totals: dict[str, float] = field(default_factory=dict)  # of OffloadService.summary()
    offload_cache_bytes: int = 0
    oldest_log_live_ledgers: int = 0
    oldest_log_pinning: list[tuple[int, int]] = field(default_factory=list)  # (ledger, bytes)


def streams_now_ms() -> float:
    """Now for stream_snapshot: the streams' times come from the system clock too."""
    return time.time() * MS_PER_S


def stream_snapshot(manager: StreamManager, stream: Stream, now_ms: float) -> StreamSnapshot:
    """A stream and its cursors. The oldest unacknowledged age is at ledger granularity (entries
    carry no time): the age of the ledger holding a cursor's next unacknowledged entry."""
    created = {info.ledger_id: info.created_ms for info in stream.ledgers}
    cursors = []
    for cursor in manager.cursors(stream.name):
        backlog = manager.backlog(stream.name, cursor.mark_delete)
        age_s = 0.0
        following = manager.next_position(stream, cursor.mark_delete)
        if backlog.entries and following is not None and following.ledger_id in created:
            age_s = max(0.0, now_ms - created[following.ledger_id]) / MS_PER_S
        cursors.append(
            CursorSnapshot(
                cursor.name,
                stream.shown_mark(cursor.mark_delete),
                backlog.entries,
                backlog.size_bytes,
                age_s,
            )
        )
    entries, size = manager.appended.get(stream.name, (0, 0))
    dedup = None
    if stream.policies.deduplication:
        producers, age_ms = manager.dedup_stats().get(stream.name, (0, -1))
        duplicates = manager.duplicates.get(stream.name, 0)
        dedup = (duplicates, producers, age_ms / MS_PER_S if age_ms >= 0 else -1.0)
    return StreamSnapshot(
        name=stream.name,
        appended_entries=entries,
        appended_bytes=size,
        rollovers=manager.rollovers_by_stream.get(stream.name, 0),
        ledgers=len(stream.ledgers),
        retained_bytes=sum(info.size_bytes for info in stream.ledgers),
        cursors=cursors,
        cursor_count=len(cursors),
        dedup=dedup,
    )


def top_streams(manager: StreamManager, limit: int) -> tuple[list[StreamSnapshot], StreamTotals]:
    """The ``limit`` streams an operator looks at first: the largest backlog of a cursor, then
    the most retained bytes (ties in name order, so the set holds still between scrapes), with
    at most ``limit`` of their cursors in all (a stream may have thousands), the largest
    backlogs; and totals over every stream and cursor. The totals need every cursor's backlog
    anyway; choosing keeps heaps of ``limit``, never a sort of all streams or cursors."""
    now_ms = streams_now_ms()
    snapshots = [stream_snapshot(manager, stream, now_ms) for stream in manager.streams()]
    totals = StreamTotals()
    for snapshot in snapshots:
        totals.add(snapshot)
    top = heapq.nlargest(limit, snapshots, key=lambda s: (s.largest_backlog, s.retained_bytes))
    cursors = ((s.name, c) for s in top for c in s.cursors)
    kept = {
        (name, c.name)
        for name, c in heapq.nlargest(limit, cursors, key=lambda pair: pair[1].backlog_entries)
    }
    for snapshot in top:
        snapshot.cursors = [c for c in snapshot.cursors if (snapshot.name, c.name) in kept]
    return top, totals


NODE_STATES = ("writable", "read_only", "shutting_down")


class StateMetrics(Collector):
    """The node's state as metrics, collected from the copy ``take_snapshot`` made on the
    event loop (the /metrics route takes one, then renders the registry on a thread)."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._snapshot = EngineSnapshot()
        metrics.registry.register(self)

    def take_snapshot(
        self,
        storage: LedgerStorage,
        shutting_down: bool,
        work: BackgroundWork | None = None,
        streams: StreamManager | None = None,
    ) -> None:
        """On the event loop: copy what the engine's structures hold."""
        by_state = dict.fromkeys((s.name.lower() for s in LedgerState), 0)
        for meta in storage.all_ledgers():
            by_state[meta.state.name.lower()] += 1
        if shutting_down or not storage.running:
            state = "shutting_down"
        elif storage.refuses_adds:
            state = "read_only"
        else:
            state = "writable"
        self._snapshot = EngineSnapshot(
            engine=dataclasses.replace(storage.stats),
            write_cache_bytes=storage.write_cache_bytes,
            read_cache_bytes=storage.read_cache.size,
            read_cache_hits=storage.read_cache.hits,
            read_cache_misses=storage.read_cache.misses,
            journal_queue_bytes=storage.wal_queued_bytes,
            index_keys=storage.index_keys_estimate() if storage.running else 0,
            long_polls=storage.lac_waiters,
            ledgers_by_state=by_state,
            state=state,
            wal_ring=self._ring_snapshot(),
        )
        if work is not None:
            status = work.gc.status
            self._snapshot.gc = dataclasses.replace(work.gc.stats)
            self._snapshot.compactions = {
                "major": status.major_compaction_counter,
                "minor": status.minor_compaction_counter,
                "space": status.space_compaction_counter,
            }
            self._snapshot.compacting = {
                "major": status.major_compacting,
                "minor": status.minor_compacting,
            }
            self._snapshot.unreadable_logs = len(status.unreadable_logs)
            self._snapshot.space_amplification = status.space_amplification
            self._snapshot.log_usages = work.gc.usages()
            self._snapshot.disk_warning = work.disks.warned
            reserve = work.disks.reserve
            self._snapshot.reserve_bytes = reserve.size if reserve.held else 0
            retention = work.retention.stats
            self._snapshot.retention = RetentionStats(
                runs=retention.runs,
                deleted=dict(retention.deleted),  # copies: the loop goes on changing them
                deleted_bytes=dict(retention.deleted_bytes),
                expired_cursor_moves=retention.expired_cursor_moves,
                last_run_ms=retention.last_run_ms,
            )
            live, pinning = work.gc.oldest_log_pinning(PINNING_LEDGERS_SHOWN)
            self._snapshot.oldest_log_live_ledgers = live
            self._snapshot.oldest_log_pinning = pinning
            offload = work.offload
            self._snapshot.offload = dataclasses.replace(
                offload.stats,
                read_latency_counts=list(offload.stats.read_latency_counts),
                store_errors=dict(offload.stats.store_errors),
            )
            self._snapshot.offload_totals = dict(offload.summary()["totals"])
            if offload._reader is not None:
                self._snapshot.offload_cache_bytes = offload.reader.cached_bytes
        if streams is not None:
            self._snapshot.streams, self._snapshot.stream_totals = top_streams(
                streams, self._metrics.settings.metrics_max_streams
            )
            self._snapshot.orphan_ledgers = len(streams.live_orphans())
            cache = streams.cache
            self._snapshot.stream_cache = (cache.stats.hits, cache.stats.misses, cache.size_bytes)

    def _ring_snapshot(self) -> RingSnapshot | None:
        ring = self._metrics.ring_figures
        if ring is None:
            return None
        return RingSnapshot(
            ring_bytes=ring.ring_bytes,
            used_bytes=ring.ring_used_bytes,
            blocks_in_flight=ring.blocks_in_flight,
            throttled_appends=ring.throttled_appends,
            rejected_appends=ring.rejected_appends,
        )

    @property
    def snapshot(self) -> EngineSnapshot:
        return self._snapshot

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot
        settings = self._metrics.settings
        e = s.engine
        counters = {
            "adds": (e.adds, "Entries added."),
            "add_payload_bytes": (e.add_bytes, "Payload bytes added."),
            "reads": (e.reads, "Entries read."),
            "read_payload_bytes": (e.read_bytes, "Payload bytes read."),
            "throttled_adds": (e.throttled_adds, "Adds that waited on a full write cache."),
            "rejected_adds": (e.rejected_adds, "Adds refused after maxThrottleTime."),
            "checkpoints": (e.checkpoints, "Checkpoints completed."),
            "replayed_records": (e.replayed_records, "WAL records replayed at start."),
            "read_cache_hits": (s.read_cache_hits, "Reads served by the read cache."),
            "read_cache_misses": (s.read_cache_misses, "Reads the read cache could not serve."),
        }
        for name, (value, doc) in counters.items():
            yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=value)
        gauges = {
            "write_cache_bytes": (s.write_cache_bytes, "Bytes in the write cache (both halves)."),
            "read_cache_bytes": (s.read_cache_bytes, "Bytes in the read cache."),
            "journal_queue_bytes": (s.journal_queue_bytes, "Bytes queued for the next WAL write."),
            "index_keys": (
                s.index_keys,
                "Keys of the locations index, one per run of entries (RocksDB estimate).",
            ),
            "lac_long_polls": (s.long_polls, "Long polls waiting for a LAC, each on a connection."),
        }
        for name, (value, doc) in gauges.items():
            yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)

        ledgers = GaugeMetricFamily(f"{PREFIX}_ledgers", "Ledgers by state.", labels=["state"])
        for state, count in sorted(s.ledgers_by_state.items()):
            ledgers.add_metric([state], count)
        yield ledgers
        node_state = GaugeMetricFamily(
            f"{PREFIX}_state", "1 for the node's current state.", labels=["state"]
        )
        for state in NODE_STATES:
            node_state.add_metric([state], 1.0 if state == s.state else 0.0)
        yield node_state
        yield GaugeMetricFamily(
            f"{PREFIX}_read_only", "1 when adds are refused.", value=float(s.state != "writable")
        )
        yield from _gc_metrics(s)
        yield from _stream_metrics(s)
        yield from _offload_metrics(s)
        if s.wal_ring is not None:
            yield from _wal_ring_metrics(s.wal_ring)
        yield from _entry_log_metrics(settings.ledgers_dir)
        yield GaugeMetricFamily(
            f"{PREFIX}_index_size_bytes",
            "Bytes of the RocksDB index on disk.",
            value=_directory_bytes(settings.index_dir),
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_audit_snapshot_bytes",
            "Bytes the node's audit snapshots take: their files and the logs only they hold.",
            value=kept.kept_bytes(settings.audit_snapshots_dir, settings.ledgers_dir),
        )
        yield from _disk_metrics(settings)
        yield from _settings_metrics(settings)
        yield GaugeMetricFamily(
            f"{PREFIX}_start_time_seconds",
            "Unix time the node started (alerts on runs that never happened count from it).",
            value=self._metrics.start_time_s,
        )
        if self._metrics.audit is not None:
            yield from _audit_metrics(self._metrics.audit)


def _audit_metrics(audit: AuditFigures) -> Iterator[Metric]:
    """Absent until an audit is posted: an alert on ``absent(...)`` or on the timestamp's
    age catches an audit that stopped running."""
    yield GaugeMetricFamily(
        f"{PREFIX}_audit_last_run_timestamp_seconds",
        "When the last audit posted to the node finished.",
        value=audit.finished_s,
    )
    violations = GaugeMetricFamily(
        f"{PREFIX}_audit_violations", "Violations the last audit found, by check.", labels=["check"]
    )
    for check, count in sorted(audit.violations.items()):
        violations.add_metric([check], count)
    yield violations


def _gc_metrics(s: EngineSnapshot) -> Iterator[Metric]:
    g = s.gc
    for name, value, doc in (
        ("gc_runs", g.runs, "Garbage collection runs."),
        ("gc_deleted_ledgers", g.deleted_ledgers, "Deleted ledgers GC has forgotten."),
        ("gc_run_seconds", g.run_seconds_total, "Time spent in GC runs."),
        ("gc_compaction_read_bytes", g.compaction_read_bytes, "Bytes compaction read."),
        ("gc_compaction_written_bytes", g.compaction_written_bytes, "Bytes compaction wrote."),
        ("gc_scanned_bytes", g.scanned_bytes, "Bytes GC read to learn logs without a map."),
        ("gc_failures", g.failures, "GC runs that failed (logged; retried at the next run)."),
    ):
        yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=value)
    reclaimed = CounterMetricFamily(
        f"{PREFIX}_gc_reclaimed_bytes", "Disk space GC gave back, by how.", labels=["by"]
    )
    reclaimed.add_metric(["deletion"], g.reclaimed_by_deletion_bytes)
    reclaimed.add_metric(["compaction"], g.reclaimed_by_compaction_bytes)
    yield reclaimed
    runs = CounterMetricFamily(
        f"{PREFIX}_gc_compactions", "Compaction runs by kind.", labels=["kind"]
    )
    compacting = GaugeMetricFamily(
        f"{PREFIX}_gc_compacting", "1 while a compaction of this kind runs.", labels=["kind"]
    )
    for kind, count in s.compactions.items():
        runs.add_metric([kind], count)
    for kind, busy in s.compacting.items():  # a space run shows as a major one
        compacting.add_metric([kind], float(busy))
    yield runs
    yield compacting
    yield GaugeMetricFamily(
        f"{PREFIX}_gc_last_success_timestamp_seconds",
        "Unix time the last successful GC run ended (0: none since start).",
        value=g.last_success_ms / MS_PER_S,
    )
    yield GaugeMetricFamily(
        f"{PREFIX}_entry_log_oldest_live_ledgers",
        "Live ledgers in the oldest entry log GC knows: what pins it (0: none or no log).",
        value=s.oldest_log_live_ledgers,
    )
    pinning = GaugeMetricFamily(
        f"{PREFIX}_entry_log_oldest_pinning_ledger_bytes",
        f"Live bytes of the largest {PINNING_LEDGERS_SHOWN} ledgers in the oldest entry log.",
        labels=["ledger"],
    )
    for ledger, size in s.oldest_log_pinning:
        pinning.add_metric([str(ledger)], size)
    yield pinning
    yield GaugeMetricFamily(
        f"{PREFIX}_gc_last_run_duration_seconds",
        "Duration of the last GC run.",
        value=g.last_run_seconds,
    )
    yield GaugeMetricFamily(
        f"{PREFIX}_gc_space_amplification",
        "Bytes of the sealed entry logs over their live bytes, at the last GC run.",
        value=s.space_amplification,
    )
    yield GaugeMetricFamily(
        f"{PREFIX}_gc_unreadable_logs",
        "Entry logs GC skipped as unreadable in its last run.",
        value=s.unreadable_logs,
    )
    yield GaugeMetricFamily(
        f"{PREFIX}_disk_warning", "1 when a data disk is past the warn watermark.",
        value=float(s.disk_warning),
    )  # fmt: skip
    yield GaugeMetricFamily(
        f"{PREFIX}_disk_emergency_reserve_bytes",
        "Bytes of the emergency reserve held; 0 once released on a full disk.",
        value=s.reserve_bytes,
    )
    buckets = [0] * USAGE_BUCKETS
    for usage in s.log_usages:
        buckets[min(USAGE_BUCKETS - 1, int(usage * USAGE_BUCKETS))] += 1
    cumulative, running = [], 0
    for i, count in enumerate(buckets):
        running += count
        bound = "+Inf" if i == USAGE_BUCKETS - 1 else str((i + 1) / USAGE_BUCKETS)
        cumulative.append((bound, running))
    yield HistogramMetricFamily(
        f"{PREFIX}_entry_log_usage",
        "Entry logs by usage (live bytes over the larger of size and log_size_limit).",
        buckets=cumulative,
        sum_value=sum(s.log_usages),
    )


def _offload_metrics(s: EngineSnapshot) -> Iterator[Metric]:
    o = s.offload
    counters = {
        "offload_runs": (o.runs, "Offload runs."),
        "offload_completed_ledgers": (o.offloaded_ledgers, "Ledgers offloaded and verified."),
        "offload_upload_bytes": (o.upload_bytes, "Bytes uploaded to the object store."),
        "offload_upload_failures": (o.upload_failures, "Offload attempts that failed."),
        "offload_objects_deleted": (o.objects_deleted, "Object deletions sent."),
        "offload_local_copies_deleted": (o.local_copies_deleted, "Local copies dropped."),
        "offload_block_cache_hits": (o.cache_hits, "Offloaded reads served from the cache."),
        "offload_block_cache_misses": (o.cache_misses, "Offloaded reads that fetched a range."),
        "offload_prefetches": (o.prefetches, "Ranges fetched ahead of sequential reads."),
        "offload_fetched_bytes": (o.fetched_bytes, "Bytes read from the object store."),
        "offload_unreadable_objects": (
            o.unreadable_objects,
            "Reads refused: an offloaded object missing or damaged, or the store failing.",
        ),
    }
    for name, (value, doc) in counters.items():
        yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=value)
    store_errors = CounterMetricFamily(
        f"{PREFIX}_offload_store_errors",
        "Object store calls that failed, by operation and error code.",
        labels=["operation", "code"],
    )
    for (operation, code), count in sorted(o.store_errors.items()):
        store_errors.add_metric([operation, code], count)
    yield store_errors
    t = s.offload_totals
    gauges = {
        "offload_ledgers": (t.get("offloadedLedgers", 0), "Ledgers offloaded."),
        "offload_bytes": (t.get("offloadedBytes", 0), "Bytes of offloaded data objects."),
        "offload_awaiting_deletion_bytes": (
            t.get("awaitingDeletionBytes", 0),
            "Local bytes of offloaded ledgers waiting for the deletion lag.",
        ),
        "offload_lag_seconds": (
            t.get("lagSeconds", 0),
            "Age of the oldest ledger due for offload and not offloaded.",
        ),
        "offload_block_cache_bytes": (s.offload_cache_bytes, "Bytes in the offload block cache."),
    }
    for name, (figure, doc) in gauges.items():
        yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=figure)
    cumulative = 0
    buckets = []
    for bound, count in zip(
        [*map(str, OFFLOAD_READ_BUCKETS), "+Inf"], o.read_latency_counts, strict=True
    ):
        cumulative += count
        buckets.append((bound, cumulative))
    yield HistogramMetricFamily(
        f"{PREFIX}_offload_object_read_seconds",
        "Latency of reads from the object store.",
        buckets=buckets,
        sum_value=o.read_latency_sum,
    )


def _wal_ring_metrics(ring: RingSnapshot) -> Iterator[Metric]:
    for name, value, doc in (
        (
            "wal_throttled_appends",
            ring.throttled_appends,
            "Raw-device WAL appends that waited for room in a full ring (rejected included).",
        ),
        (
            "wal_rejected_appends",
            ring.rejected_appends,
            "Raw-device WAL appends refused with back-pressure: no checkpoint freed room in "
            "db_storage_max_throttle_time_ms.",
        ),
    ):
        yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=value)
    for name, value, doc in (
        (
            "wal_ring_used_bytes",
            ring.used_bytes,
            "Bytes of the raw-device WAL's ring from the trim offset to the newest block.",
        ),
        (
            "wal_ring_capacity_bytes",
            ring.ring_bytes,
            "Bytes of the raw-device WAL's ring for records (wal_capacity less the header area).",
        ),
        (
            "wal_blocks_in_flight",
            ring.blocks_in_flight,
            "Raw-device WAL blocks being written and not yet acknowledged.",
        ),
    ):
        yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)


def _stream_metrics(s: EngineSnapshot) -> Iterator[Metric]:
    stream_label, cursor_labels = ["stream"], ["stream", "cursor"]
    appended = CounterMetricFamily(
        f"{PREFIX}_stream_append_entries", "Entries appended to the stream.", labels=stream_label
    )
    appended_bytes = CounterMetricFamily(
        f"{PREFIX}_stream_append_payload_bytes",
        "Payload bytes appended to the stream.",
        labels=stream_label,
    )
    rollovers = CounterMetricFamily(
        f"{PREFIX}_stream_rollovers",
        "Rollovers: the stream's ledger taking appends closed and a new one opened.",
        labels=stream_label,
    )
    ledgers = GaugeMetricFamily(
        f"{PREFIX}_stream_ledgers", "Ledgers the stream holds.", labels=stream_label
    )
    retained = GaugeMetricFamily(
        f"{PREFIX}_stream_retained_bytes",
        "Payload bytes in the stream's ledgers (backlog and retained acknowledged data).",
        labels=stream_label,
    )
    backlog = GaugeMetricFamily(
        f"{PREFIX}_stream_backlog_entries",
        "Entries after the cursor's mark-delete position.",
        labels=cursor_labels,
    )
    backlog_bytes = GaugeMetricFamily(
        f"{PREFIX}_stream_backlog_bytes",
        "Payload bytes after the cursor's mark-delete position.",
        labels=cursor_labels,
    )
    oldest = GaugeMetricFamily(
        f"{PREFIX}_stream_oldest_unacknowledged_age_seconds",
        "Age of the ledger holding the cursor's next unacknowledged entry (0: no backlog).",
        labels=cursor_labels,
    )
    deleted = CounterMetricFamily(
        f"{PREFIX}_stream_retention_deleted_ledgers",
        "Ledgers retention deleted, by why: time, size or disk (pressure).",
        labels=["stream", "reason"],
    )
    deleted_bytes = CounterMetricFamily(
        f"{PREFIX}_stream_retention_deleted_bytes",
        "Payload bytes of the ledgers retention deleted, by why.",
        labels=["stream", "reason"],
    )
    duplicates = CounterMetricFamily(
        f"{PREFIX}_stream_dedup_duplicates",
        "Appends answered as duplicates (a producer's sequence id stored already).",
        labels=stream_label,
    )
    producers = GaugeMetricFamily(
        f"{PREFIX}_stream_dedup_producers",
        "Producers the stream's deduplication table tracks on this node.",
        labels=stream_label,
    )
    snapshot_age = GaugeMetricFamily(
        f"{PREFIX}_stream_dedup_snapshot_age_seconds",
        "Age of the deduplication table's snapshot (-1: none taken or loaded yet).",
        labels=stream_label,
    )
    r = s.retention
    for stream in s.streams:
        label = [stream.name]
        if stream.dedup is not None:
            duplicates.add_metric(label, stream.dedup[0])
            producers.add_metric(label, stream.dedup[1])
            snapshot_age.add_metric(label, stream.dedup[2])
        appended.add_metric(label, stream.appended_entries)
        appended_bytes.add_metric(label, stream.appended_bytes)
        rollovers.add_metric(label, stream.rollovers)
        ledgers.add_metric(label, stream.ledgers)
        retained.add_metric(label, stream.retained_bytes)
        for cursor in stream.cursors:
            labels = [stream.name, cursor.name]
            backlog.add_metric(labels, cursor.backlog_entries)
            backlog_bytes.add_metric(labels, cursor.backlog_bytes)
            oldest.add_metric(labels, cursor.oldest_unacknowledged_age_s)
        for reason in RETENTION_REASONS:
            key = (stream.name, reason)
            deleted.add_metric([stream.name, reason], r.deleted.get(key, 0))
            deleted_bytes.add_metric([stream.name, reason], r.deleted_bytes.get(key, 0))
    yield from (appended, appended_bytes, rollovers, ledgers, retained, backlog, backlog_bytes)
    yield from (oldest, deleted, deleted_bytes, duplicates, producers, snapshot_age)
    yield from _stream_totals_metrics(s.stream_totals, r)
    hits, misses, cached = s.stream_cache
    yield CounterMetricFamily(
        f"{PREFIX}_stream_entry_cache_hits",
        "Stream entries a read took from the owner's entry cache (replicated streams).",
        value=hits,
    )
    yield CounterMetricFamily(
        f"{PREFIX}_stream_entry_cache_misses",
        "Stream entries a read took from their ledger instead of the entry cache.",
        value=misses,
    )
    yield GaugeMetricFamily(
        f"{PREFIX}_stream_entry_cache_bytes",
        "Payload bytes in the owner's entry cache (bounded by stream_entry_cache_bytes).",
        value=cached,
    )
    yield CounterMetricFamily(f"{PREFIX}_retention_runs", "Retention runs.", value=r.runs)
    yield GaugeMetricFamily(
        f"{PREFIX}_retention_last_run_timestamp_seconds",
        "Unix time the last retention run ended (0: none since start).",
        value=r.last_run_ms / MS_PER_S,
    )
    yield GaugeMetricFamily(
        f"{PREFIX}_stream_orphan_ledgers",
        "Ledgers of streams that no stream names yet hold entries, kept at start (the log "
        "names them; an operator reads, then deletes them).",
        value=s.orphan_ledgers,
    )
    yield CounterMetricFamily(
        f"{PREFIX}_retention_ttl_cursor_moves",
        "Cursors a message TTL moved past expired ledgers.",
        value=r.expired_cursor_moves,
    )


def _stream_totals_metrics(t: StreamTotals, r: RetentionStats) -> Iterator[Metric]:
    """Over every stream: what the per-stream series of the largest backlogs leave out."""
    for name, value, doc in (
        ("streams", t.streams, "Streams on the node."),
        ("streams_cursors", t.cursors, "Cursors of all streams."),
        ("streams_backlog_entries", t.backlog_entries, "Backlog entries of all cursors."),
        ("streams_backlog_bytes", t.backlog_bytes, "Backlog payload bytes of all cursors."),
        ("streams_retained_bytes", t.retained_bytes, "Payload bytes in all streams' ledgers."),
        (
            "streams_oldest_unacknowledged_age_seconds",
            t.oldest_unacknowledged_age_s,
            "The largest oldest unacknowledged age of any cursor (0: no backlog).",
        ),
    ):
        yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)
    deleted = CounterMetricFamily(
        f"{PREFIX}_retention_deleted_ledgers",
        "Ledgers retention deleted from all streams (deleted streams too), by why.",
        labels=["reason"],
    )
    deleted_bytes = CounterMetricFamily(
        f"{PREFIX}_retention_deleted_bytes",
        "Payload bytes of the ledgers retention deleted from all streams, by why.",
        labels=["reason"],
    )
    for reason in RETENTION_REASONS:
        deleted.add_metric([reason], sum(n for (_, why), n in r.deleted.items() if why == reason))
        deleted_bytes.add_metric(
            [reason], sum(n for (_, why), n in r.deleted_bytes.items() if why == reason)
        )
    yield deleted
    yield deleted_bytes


def _entry_log_metrics(ledgers_dir: Path) -> Iterator[Metric]:
    sizes = []
    oldest_mtime = None
    now = time.time()
    try:
        entries = list(os.scandir(ledgers_dir))
    except FileNotFoundError:
        entries = []
    for entry in entries:
        if entry.name.endswith(ENTRY_LOG_SUFFIX) and entry.is_file():
            stat = entry.stat()
            sizes.append(stat.st_size)
            oldest_mtime = (
                stat.st_mtime if oldest_mtime is None else min(oldest_mtime, stat.st_mtime)
            )
    yield GaugeMetricFamily(f"{PREFIX}_entry_logs", "Entry log files.", value=len(sizes))
    yield GaugeMetricFamily(
        f"{PREFIX}_entry_log_bytes", "Bytes of all entry log files.", value=sum(sizes)
    )
    yield GaugeMetricFamily(
        f"{PREFIX}_entry_log_oldest_age_seconds",
        "Seconds since the least recently written entry log was last written (0: none).",
        value=max(0.0, now - oldest_mtime) if oldest_mtime is not None else 0.0,
    )


def _directory_bytes(path: Path) -> int:
    try:
        return sum(e.stat().st_size for e in os.scandir(path) if e.is_file())
    except FileNotFoundError:
        return 0


def _disk_metrics(settings: Settings) -> Iterator[Metric]:
    labels = ["dir"]
    used = GaugeMetricFamily(f"{PREFIX}_disk_used_bytes", "Used bytes of the disk.", labels=labels)
    total = GaugeMetricFamily(f"{PREFIX}_disk_total_bytes", "Size of the disk.", labels=labels)
    ratio = GaugeMetricFamily(
        f"{PREFIX}_disk_usage_ratio",
        "Used / total of the disk holding each data dir.",
        labels=labels,
    )
    for name, path in data_dirs(settings).items():
        try:
            stat = os.statvfs(path)
        except FileNotFoundError:
            continue
        size = stat.f_blocks * stat.f_frsize
        free = stat.f_bavail * stat.f_frsize
        used.add_metric([name], size - free)
        total.add_metric([name], size)
        ratio.add_metric([name], (size - free) / size if size else 0.0)
    yield used
    yield total
    yield ratio


def _settings_metrics(settings: Settings) -> Iterator[Metric]:
    """The settings alerts compare against, so that one rule fits nodes configured apart
    (Prometheus has no other way to know a node's watermarks and intervals)."""
    retention_s = (
        math.inf
        if settings.default_retention_time_in_minutes < 0
        else settings.default_retention_time_in_minutes * 60.0
    )
    for name, value, doc in (
        (
            "disk_usage_warn_threshold_ratio",
            settings.disk_usage_warn_threshold,
            "disk_usage_warn_threshold: above it a warning and disk_warning.",
        ),
        (
            "disk_usage_read_only_threshold_ratio",
            settings.disk_usage_threshold,
            "disk_usage_threshold: above it the node turns read-only.",
        ),
        (
            "gc_interval_seconds",
            settings.gc_wait_time_ms / MS_PER_S,
            "gc_wait_time_ms: the period of GC runs.",
        ),
        (
            "major_compaction_interval_seconds",
            float(settings.major_compaction_interval_s),
            "major_compaction_interval_s (0: major compaction off).",
        ),
        (
            "default_retention_seconds",
            retention_s,
            "default_retention_time_in_minutes in seconds (+Inf: kept forever).",
        ),
        ("http_max_connections", settings.max_connections, "max_connections in effect."),
    ):
        yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)
