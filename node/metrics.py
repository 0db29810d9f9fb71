"""Every Prometheus metric the node declares, named once (prefix ``storage_node_``, base units),
on the floor below replication, streams and HTTP, which observe them: this module imports the
settings and the engine's probe only.

Two kinds here:
- histograms observed as things happen: HTTP requests (by method, route template and
  status), adds and reads, journal group writes, checkpoints, raw-device WAL blocks (the
  engine reports the last three through the StorageProbe protocol);
- counters and gauges set by their owners (connections, forwarded requests, replication's
  registration and sweeps) and the fleet's autorecovery figures read from the store.

The node's state at scrape time (the engine's caches and counters, GC, disks, retention,
offload, streams, the file system) is collected beside the background work that holds it:
node/lifecycle/metrics.py, registered on the same registry.

Labels are bounded: route templates (never ids), ledger states, data dir kinds.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from node.settings import Settings
from node.storage.probe import RingFigures

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


class Metrics:
    """The node's metrics on their own registry (one per application, so tests can run
    several nodes in one process). Implements the engine's StorageProbe."""

    def __init__(self, settings: Settings) -> None:
        self.registry = CollectorRegistry()
        self._settings = settings
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

    def render(self) -> bytes:
        """Blocking (the state collector reads the file system): call on a worker thread."""
        return bytes(generate_latest(self.registry))

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
