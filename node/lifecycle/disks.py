"""Disk watermarks (BookKeeper's LedgerDirsMonitor, RocketMQ's disk ratios), checked every
``disk_check_interval`` for each data dir:

- above ``gc_disk_usage_threshold`` (0.85): garbage collection runs at once;
- above ``disk_usage_warn_threshold`` (0.90): a warning, and the metric says so;
- above ``disk_usage_threshold`` (0.95): the node turns read-only (adds get 507), reads go on;
- back under ``disk_usage_lwm_threshold``: writable again, without a restart; this also
  lifts the read-only mode the storage enters itself when a write finds no space (ENOSPC).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from pathlib import Path

from node.lifecycle.gc import GarbageCollector
from node.storage.ledgers import DISK, LedgerStorage

log = logging.getLogger(__name__)


def usage(path: Path) -> float:
    """Used share of the file system holding ``path`` (its parent if it does not exist)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    stat = os.statvfs(path)
    total = stat.f_blocks * stat.f_frsize
    return 1.0 - stat.f_bavail * stat.f_frsize / total if total else 0.0


class DiskMonitor:
    def __init__(
        self,
        storage: LedgerStorage,
        gc: GarbageCollector,
        measure: Callable[[Path], float] = usage,
    ) -> None:
        self._storage = storage
        self._gc = gc
        self._settings = storage.settings
        self._measure = measure
        self.usages: dict[str, float] = {}
        self.warned = False

    def dirs(self) -> dict[str, Path]:
        s = self._settings
        return {"journal": s.journal_dir, "ledgers": s.ledgers_dir, "index": s.index_dir}

    def measure(self) -> dict[str, float]:
        """Blocking (statvfs): call on a worker thread."""
        return {name: self._measure(path) for name, path in self.dirs().items()}

    def apply(self, usages: dict[str, float]) -> None:
        """Act on measured usages (on the event loop)."""
        s = self._settings
        self.usages = usages
        worst_dir, worst = max(usages.items(), key=lambda item: item[1])
        if worst > s.gc_disk_usage_threshold:
            self._gc.request()
        self.warned = worst > s.disk_usage_warn_threshold
        if self.warned:
            log.warning("disk of %s is %.1f%% full", worst_dir, worst * 100)
        full = self._storage.read_only_source(DISK)
        if worst > s.disk_usage_threshold and not full:
            self._storage.set_read_only(
                f"disk of {worst_dir} is {worst:.1%} full (limit {s.disk_usage_threshold:.0%})",
                DISK,
            )
            self._gc.disk_full = True
            self._gc.request()
        elif full and worst < s.disk_usage_lwm_threshold:
            # Whoever set it: this monitor, or the storage when a write found no space.
            self._storage.set_read_only(None, DISK)
            self._gc.disk_full = False
        elif full and not self._gc.disk_full:
            # The storage turned read-only itself (ENOSPC before the full watermark: a
            # burst, a quota, another tenant of the disk): GC runs now, as above.
            self._gc.disk_full = True
            self._gc.request()

    async def check(self) -> None:
        self.apply(await asyncio.to_thread(self.measure))

    async def run_forever(self) -> None:
        interval = self._settings.disk_check_interval / 1000
        while True:
            try:
                await self.check()
            except OSError:
                log.exception("disk check failed")
            await asyncio.sleep(interval)
