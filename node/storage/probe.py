"""What the engine reports as it works (Redpanda's "probe"): one object receives every
event worth a metric. The engine knows only this protocol; node/metrics.py implements it
with Prometheus, so storage never imports the metrics library. ``Stats`` holds the
engine's counters, which metrics and benchmarks read.

Methods may be called from the journal and checkpoint threads: implementations must be
thread safe (prometheus-client's metrics are).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(slots=True)
class Stats:
    """Counters of the engine, read by metrics and benchmarks."""

    adds: int = 0
    add_bytes: int = 0
    reads: int = 0
    read_bytes: int = 0
    throttled_adds: int = 0
    rejected_adds: int = 0
    checkpoints: int = 0
    last_checkpoint_ms: int = 0  # wall clock of the last checkpoint's end; 0: none since start
    # The flush thread's work (entry log, fsync, index) of the checkpoints done: its rate is
    # what BookKeeper quotes for its single flush thread (~250K 1 KB entries/s, PR 1289).
    flushed_entries: int = 0
    flush_seconds_total: float = 0.0
    replayed_records: int = 0


class RingFigures(Protocol):
    """The raw-device WAL's ring as it is now. It belongs to the event loop: read it there."""

    @property
    def ring_bytes(self) -> int:
        """Room for records: the capacity less the header area."""
        ...

    @property
    def ring_used_bytes(self) -> int:
        """Bytes from the trim offset to the end of the newest block (at most ring_bytes)."""
        ...

    @property
    def blocks_in_flight(self) -> int:
        """Blocks being written and not yet acknowledged."""
        ...

    @property
    def throttled_appends(self) -> int:
        """Appends that waited for room in a full ring (the rejected ones included)."""
        ...

    @property
    def rejected_appends(self) -> int:
        """Appends refused with back-pressure: the ring stayed full too long."""
        ...


class StorageProbe(Protocol):
    def journal_write(
        self, records: int, size_bytes: int, write_seconds: float, sync_seconds: float
    ) -> None:
        """One group write of the WAL: records and bytes in it, pwrite and fsync times."""
        ...

    def checkpoint(self, seconds: float, entries: int, size_bytes: int) -> None:
        """A checkpoint that wrote ``entries`` (``size_bytes`` of entry log) in ``seconds``."""
        ...

    def wal_block(self, size_bytes: int) -> None:
        """A block of the raw-device WAL durable: ``size_bytes`` as written (padding included)."""
        ...

    def wal_ring(self, ring: RingFigures) -> None:
        """The raw-device WAL started: its ring's figures, to read on the event loop."""
        ...


class NullProbe:
    def journal_write(
        self, records: int, size_bytes: int, write_seconds: float, sync_seconds: float
    ) -> None:
        pass

    def checkpoint(self, seconds: float, entries: int, size_bytes: int) -> None:
        pass

    def wal_block(self, size_bytes: int) -> None:
        pass

    def wal_ring(self, ring: RingFigures) -> None:
        pass
