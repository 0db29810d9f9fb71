"""Counters of offload and of reads from the object store, read by /metrics and status."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

# Object reads: from a local-store hit (~100 µs) to a slow S3 GET (seconds).
READ_LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0,
)  # fmt: skip


@dataclass(slots=True)
class OffloadStats:
    runs: int = 0
    offloaded_ledgers: int = 0  # offloads completed by this process
    upload_bytes: int = 0
    upload_failures: int = 0
    objects_deleted: int = 0
    uploads_aborted: int = 0  # multipart uploads a killed node left, aborted
    local_copies_deleted: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    prefetches: int = 0
    fetched_bytes: int = 0  # data object bytes read back for reads
    unreadable_objects: int = 0  # reads refused: an object missing or damaged, or the store failing
    # store failures by (operation, error code): timeouts, refused connections, error statuses
    store_errors: dict[tuple[str, str], int] = field(default_factory=dict)
    # cumulative read latency histogram: counts per bucket (plus +Inf), sum
    read_latency_counts: list[int] = field(
        default_factory=lambda: [0] * (len(READ_LATENCY_BUCKETS) + 1)
    )
    read_latency_sum: float = 0.0

    def object_read(self, seconds: float, size: int) -> None:
        self.read_latency_counts[bisect_left(READ_LATENCY_BUCKETS, seconds)] += 1
        self.read_latency_sum += seconds
        self.fetched_bytes += size
