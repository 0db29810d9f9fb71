"""Every Prometheus metric of the node, named once (prefix ``storage_node_``, base units).

Three kinds of sources:
- histograms observed as things happen: HTTP requests (by method, route template and
  status), adds and reads, journal group writes, checkpoints, raw-device WAL blocks (the
  engine reports the last three through the StorageProbe protocol);
- a snapshot of the engine's state taken on the event loop when /metrics is scraped
  (caches, counters, ledgers, node state, the raw-device WAL's ring): the engine's
  structures belong to the loop;
- the file system, read at scrape time on a worker thread: entry logs, index size, disks.

Labels are bounded: route templates (never ids), ledger states, data dir kinds; streams and
cursors are named by their operators (as Pulsar labels its topics), and a deleted stream's
series go with it. A node may hold many thousands of streams: only the ``metrics_max_streams``
with the largest backlog have series of their own, and ``streams_*`` aggregates cover all.
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

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
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
from node.offload.stats import READ_LATENCY_BUCKETS as OFFLOAD_READ_BUCKETS
from node.offload.stats import OffloadStats
from node.settings import Settings
from node.storage.index import LedgerState
from node.storage.ledgers import LedgerStorage
from node.storage.logformat import SUFFIX as ENTRY_LOG_SUFFIX
from node.storage.probe import RingFigures, Stats
from node.streams.manager import StreamManager
from node.streams.model import Position, Stream

PREFIX = "storage_node"

# Latencies from 100 µs (a cache hit) to 10 s (maxThrottleTime).
LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0,
)  # fmt: skip
# Journal groups: from one small record to the 512 KiB threshold and a few times over.
GROUP_RECORD_BUCKETS = (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000)
GROUP_BYTE_BUCKETS = tuple(float(512 * 4**i) for i in range(10))  # 512 B .. 128 MiB
# Raw-device WAL blocks: 4 KiB (one small record) .. 256 KiB (the soft limit) .. one largest entry.
BLOCK_BYTE_BUCKETS = tuple(float(4096 * 2**i) for i in range(12))  # 4 KiB .. 8 MiB
MS_PER_S = 1000.0
RETENTION_REASONS = ("time", "size", "disk")  # why retention deleted a stream's ledger
# Ledgers named as pinning the oldest entry log: the largest few, so the label stays bounded.
PINNING_LEDGERS_SHOWN = 10


@dataclass(slots=True, frozen=True)
class AuditFigures:
    finished_s: float  # when the audit job finished (its clock), s since the epoch
    violations: dict[str, int]  # by check


@dataclass(slots=True)
class FleetFigures:
    """The fleet's autorecovery as the metadata store says (node/replication/fleet.py reads
    ``autorecovery/auditor`` and ``autorecovery/totals`` every autorecovery_poll_s). Every node
    with a store exports the same figures: whichever Prometheus scrapes, ``max()`` over the
    fleet is the store's view, and it survives the loss of any one node."""

    under_replicated_ledgers: int = 0
    under_replicated_fragments: int = 0
    lost_nodes: int = 0
    # nodes with a cookie and no registration now (the poll's own reading, not an audit's):
    # a dead node fires no alert of its own, every other node counts it
    unregistered_nodes: int = 0
    last_run_s: float | None = None  # the last audit's finishedMs; None until one is read
    rereplicated_fragments: int = 0
    rereplicated_entries: int = 0
    rereplicated_bytes: int = 0
    poll_errors: int = 0  # reads that failed (unreachable store, a value that does not decode)


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


class Metrics:
    """The node's metrics on their own registry (one per application, so tests can run
    several nodes in one process). Implements the engine's StorageProbe."""

    def __init__(self, settings: Settings) -> None:
        self.registry = CollectorRegistry()
        self._settings = settings
        self._snapshot = EngineSnapshot()
        self._ring: RingFigures | None = None
        self._start_time_s = time.time()
        self._audit: AuditFigures | None = None

        def histogram(
            name: str,
            doc: str,
            labels: tuple[str, ...] = (),
            buckets: tuple[float, ...] = LATENCY_BUCKETS,
        ) -> Histogram:
            return Histogram(
                f"{PREFIX}_{name}", doc, labels, registry=self.registry, buckets=buckets
            )

        self.http_request_duration = histogram(
            "http_request_duration_seconds",
            "HTTP requests by method, route template and status, and how long they took.",
            ("method", "route", "status"),
        )
        self.request_body_bytes = Gauge(
            f"{PREFIX}_http_request_body_bytes_in_flight",
            "Bytes of request bodies held, out of max_request_bytes_in_flight.",
            registry=self.registry,
        )
        # Set by the server (node/http/connections.py), which holds the connections.
        self.http_connections = Gauge(
            f"{PREFIX}_http_connections",
            "Open HTTP connections (long polls included), out of max_connections.",
            registry=self.registry,
        )
        # The bookie protocol of replicated ledgers (node/http/ledgers.py).
        self.replica_fences, self.replica_adds_refused_fenced = (
            Counter(f"{PREFIX}_{name}", doc, registry=self.registry)
            for name, doc in (
                ("replica_fences", "Fencing reads (fence=1) of replicated ledgers received."),
                (
                    "replica_adds_refused_fenced",
                    "Replica adds refused: a recovery fenced the ledger (ledger_fenced).",
                ),
            )
        )
        self.http_refused_connections = Counter(
            f"{PREFIX}_http_refused_connections",
            "Connections refused past max_connections (503 too_many_connections).",
            registry=self.registry,
        )
        # Stream requests this node sent on to the stream's owner (node/http/forward.py).
        self.stream_forwarded_requests = Counter(
            f"{PREFIX}_stream_forwarded_requests",
            "Stream requests forwarded to the stream's owner, by outcome: ok (the owner "
            "answered), unreachable (no answer: 503 owner_unreachable, or its answer broke "
            "off), unknown (an append sent, no answer: 503 append_outcome_unknown).",
            ("outcome",),
            registry=self.registry,
        )
        self.read_reply_bytes = Gauge(
            f"{PREFIX}_http_read_reply_bytes_in_flight",
            "Bytes of read replies held, out of max_read_bytes_in_flight.",
            registry=self.registry,
        )
        # Replicated ledgers (node/replication): only a node with a metadata store has them.
        self.registration_up: Gauge | None = None
        self.fleet: FleetFigures | None = None  # set with a store: the autorecovery figures
        self.registrations: Counter | None = None
        self.replication_gc_skipped: Counter | None = None
        self.replication_gc_reclaimed: Counter | None = None
        self.replication_gc_overreplicated: Counter | None = None
        self.streams_owned: Gauge | None = None
        self.stream_takeovers: Counter | None = None
        if settings.metadata_url:
            self.fleet = FleetFigures()
            self.registry.register(_FleetCollector(self.fleet))
            self.registration_up = Gauge(
                f"{PREFIX}_registration_up",
                "1 while nodes/<id> is held under a live lease in the metadata store, else 0.",
                registry=self.registry,
            )
            self.registrations = Counter(
                f"{PREFIX}_registrations",
                "Leases granted for nodes/<id> (1 at start; more: a lease expired or was lost).",
                registry=self.registry,
            )
            self.replication_gc_skipped = Counter(
                f"{PREFIX}_replication_gc_skipped",
                "Replicas the GC sweep or a delete kept because the store could not confirm "
                "(error, timeout, another cluster).",
                registry=self.registry,
            )
            self.replication_gc_reclaimed = Counter(
                f"{PREFIX}_replication_gc_reclaimed",
                "Replicas deleted by the sweep once the store said their ledger was gone.",
                registry=self.registry,
            )
            self.replication_gc_overreplicated = Counter(
                f"{PREFIX}_replication_gc_overreplicated_reclaimed",
                "Replicas deleted by the sweep because no segment of their ledger names this "
                "node (an interrupted re-replication's copy), after the over-replicated grace.",
                registry=self.registry,
            )
            self.streams_owned = Gauge(
                f"{PREFIX}_streams_owned",
                "Replicated streams this node serves now (it holds stream-owners/<name>).",
                registry=self.registry,
            )
            self.stream_takeovers = Counter(
                f"{PREFIX}_stream_takeovers",
                "Replicated streams this node took over from no live owner (fenced and "
                "recovered the last ledger when it was open).",
                registry=self.registry,
            )
        self.add_latency = histogram(
            "add_latency_seconds",
            "Time from receiving an add (one entry or a batch) to its durable acknowledgment.",
            ("kind",),
        )
        self.read_latency = histogram(
            "read_latency_seconds", "Time to serve a read (one entry or a range).", ("kind",)
        )
        # The add path's children, looked up once (labels() costs a lock and a dict walk).
        self.add_latency_single = self.add_latency.labels("single")
        self.add_latency_batch = self.add_latency.labels("batch")
        self.add_latency_stream = self.add_latency.labels("stream")
        self._request_children: dict[tuple[str, str, int], Histogram] = {}
        self.journal_group_records = histogram(
            "journal_group_records", "Records per WAL group write.", buckets=GROUP_RECORD_BUCKETS
        )
        self.journal_group_bytes = histogram(
            "journal_group_bytes", "Bytes per WAL group write.", buckets=GROUP_BYTE_BUCKETS
        )
        self.journal_write_seconds = histogram(
            "journal_write_seconds", "Time of the pwrite of a WAL group."
        )
        self.journal_fsync_seconds = histogram(
            "journal_fsync_seconds", "Time of the fdatasync that makes a WAL group durable."
        )
        self.checkpoint_seconds = histogram(
            "checkpoint_duration_seconds",
            "Checkpoint: write cache to entry log, fsync, index batch, lastMark.",
        )
        self.wal_block_bytes = histogram(
            "wal_block_bytes",
            "Blocks the raw-device WAL made durable, by bytes written (padding included).",
            buckets=BLOCK_BYTE_BUCKETS,
        )
        self.registry.register(_StateCollector(self))

    # --- StorageProbe ----------------------------------------------------------------------

    def observe_request(self, method: str, route: str, status: int, seconds: float) -> None:
        """One HTTP request in http_request_duration_seconds, by route template."""
        key = (method, route, status)
        child = self._request_children.get(key)
        if child is None:
            child = self._request_children[key] = self.http_request_duration.labels(
                method, route, str(status)
            )
        child.observe(seconds)

    def journal_write(
        self, records: int, size_bytes: int, write_seconds: float, sync_seconds: float
    ) -> None:
        self.journal_group_records.observe(records)
        self.journal_group_bytes.observe(size_bytes)
        self.journal_write_seconds.observe(write_seconds)
        self.journal_fsync_seconds.observe(sync_seconds)

    def checkpoint(self, seconds: float, entries: int, size_bytes: int) -> None:
        self.checkpoint_seconds.observe(seconds)

    def wal_block(self, size_bytes: int) -> None:
        self.wal_block_bytes.observe(size_bytes)

    def wal_ring(self, ring: RingFigures) -> None:
        self._ring = ring

    def audit_result(self, finished_ms: int, violations: dict[str, int]) -> None:
        """The last audit summary posted to the node (POST /api/v1/audit/result)."""
        self._audit = AuditFigures(finished_ms / MS_PER_S, dict(violations))

    @property
    def audit(self) -> AuditFigures | None:
        return self._audit

    # --- scraping --------------------------------------------------------------------------

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
                streams, self._settings.metrics_max_streams
            )
            self._snapshot.orphan_ledgers = len(streams.live_orphans())
            cache = streams.cache
            self._snapshot.stream_cache = (cache.stats.hits, cache.stats.misses, cache.size_bytes)

    def _ring_snapshot(self) -> RingSnapshot | None:
        ring = self._ring
        if ring is None:
            return None
        return RingSnapshot(
            ring_bytes=ring.ring_bytes,
            used_bytes=ring.ring_used_bytes,
            blocks_in_flight=ring.blocks_in_flight,
            throttled_appends=ring.throttled_appends,
            rejected_appends=ring.rejected_appends,
        )

    def render(self) -> bytes:
        """Blocking (reads the file system): call on a worker thread."""
        return bytes(generate_latest(self.registry))

    @property
    def snapshot(self) -> EngineSnapshot:
        return self._snapshot

    @property
    def ring_figures(self) -> RingFigures | None:
        """The raw-device WAL's ring, once it started (None with the file journal)."""
        return self._ring

    @property
    def settings(self) -> Settings:
        return self._settings

    @property
    def start_time_s(self) -> float:
        return self._start_time_s


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
    return StreamSnapshot(
        name=stream.name,
        appended_entries=entries,
        appended_bytes=size,
        rollovers=manager.rollovers_by_stream.get(stream.name, 0),
        ledgers=len(stream.ledgers),
        retained_bytes=sum(info.size_bytes for info in stream.ledgers),
        cursors=cursors,
        cursor_count=len(cursors),
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


class _StateCollector(Collector):
    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        s = self._metrics.snapshot
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


class _FleetCollector(Collector):
    """The autorecovery figures read from the store. A collector rather than Gauge/Counter
    objects: the totals are the fleet's counters kept in ``autorecovery/totals`` (workers add
    to them after each fragment), so the node sets them rather than increments them, and a
    prometheus_client Counter can only be incremented; exported as counter families they keep
    the counter type that rate() and increase() expect (a Gauge named ``..._total`` would be
    typed gauge). The last run's timestamp is absent until a first audit report is read."""

    def __init__(self, fleet: FleetFigures) -> None:
        self._fleet = fleet

    def collect(self) -> Iterator[Metric]:
        f = self._fleet
        for name, value, doc in (
            (
                "under_replicated_ledgers",
                f.under_replicated_ledgers,
                "Ledgers with an under-replicated marker after the last audit (fleet-wide).",
            ),
            (
                "under_replicated_fragments",
                f.under_replicated_fragments,
                "Fragments (ledger, segment, node) to re-replicate after the last audit.",
            ),
            (
                "lost_nodes",
                f.lost_nodes,
                "Known nodes unregistered longer than the lost-node delay (last audit).",
            ),
            (
                "unregistered_nodes",
                f.unregistered_nodes,
                "Known nodes (a cookie) not registered now, as of the last poll (fleet-wide).",
            ),
        ):
            yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)
        if f.last_run_s is not None:
            yield GaugeMetricFamily(
                f"{PREFIX}_autorecovery_last_run_timestamp_seconds",
                "When the last autorecovery audit finished (its report in the store).",
                value=f.last_run_s,
            )
        for name, value, doc in (
            ("fragments", f.rereplicated_fragments, "Fragments re-replicated by the fleet."),
            ("entries", f.rereplicated_entries, "Entries copied by re-replication (fleet)."),
            ("bytes", f.rereplicated_bytes, "Payload bytes copied by re-replication (fleet)."),
        ):
            yield CounterMetricFamily(f"{PREFIX}_rereplicated_{name}", doc, value=value)
        yield CounterMetricFamily(
            f"{PREFIX}_autorecovery_poll_errors",
            "Reads of the autorecovery keys that failed (the figures keep their last values).",
            value=f.poll_errors,
        )


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
    r = s.retention
    for stream in s.streams:
        label = [stream.name]
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
    yield from (oldest, deleted, deleted_bytes)
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


def data_dirs(settings: Settings) -> dict[str, Path]:
    return {
        "journal": settings.journal_dir,
        "ledgers": settings.ledgers_dir,
        "index": settings.index_dir,
    }
