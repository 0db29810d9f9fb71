"""What the engine reports as it works (Redpanda's "probe"): one object receives every
event worth a metric. The engine knows only this protocol; node/metrics.py implements it
with Prometheus, so storage never imports the metrics library.

Methods may be called from the journal and checkpoint threads: implementations must be
thread safe (prometheus-client's metrics are).
"""

from __future__ import annotations

from typing import Protocol


class StorageProbe(Protocol):
    def journal_write(
        self, records: int, size_bytes: int, write_seconds: float, sync_seconds: float
    ) -> None:
        """One group write of the WAL: records and bytes in it, pwrite and fsync times."""
        ...

    def checkpoint(self, seconds: float, entries: int, size_bytes: int) -> None:
        """A checkpoint that wrote ``entries`` (``size_bytes`` of entry log) in ``seconds``."""
        ...


class NullProbe:
    def journal_write(
        self, records: int, size_bytes: int, write_seconds: float, sync_seconds: float
    ) -> None:
        pass

    def checkpoint(self, seconds: float, entries: int, size_bytes: int) -> None:
        pass
