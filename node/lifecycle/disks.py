"""Disk watermarks (BookKeeper's LedgerDirsMonitor, RocketMQ's disk ratios), checked every
``disk_check_interval_ms`` for each data dir:

- above ``gc_disk_usage_threshold`` (0.85): garbage collection runs at once;
- above ``disk_usage_warn_threshold`` (0.90): a warning, and the metric says so;
- above ``disk_usage_threshold`` (0.95): the node turns read-only (adds get 507), reads go on;
- back under ``disk_usage_lwm_threshold``: writable again, without a restart; this also
  lifts the read-only mode the storage enters itself when a write finds no space (ENOSPC).

An emergency reserve (CockroachDB's ballast): a file of ``disk_emergency_reserve_bytes`` kept
in the data dir and deleted once the node is read-only for want of space. A disk filled to
the last block by someone else leaves RocksDB unable to reopen (it must flush its WAL) and
compaction nothing to copy into, so deleting ledgers alone frees nothing; the reserve's
blocks let the index and GC work. It is made again once the disk has room for it while
staying under the GC watermark (so that making it never turns the node read-only).

Out of space, the audit snapshots go too: each holds its entry logs by hard links, so the
logs GC deletes meanwhile keep their blocks until the snapshot is gone.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from pathlib import Path

from node.audit import kept
from node.lifecycle.gc import GarbageCollector
from node.settings import Settings
from node.storage.clock import Clock
from node.storage.fsutil import fsync_dir, is_no_space, usage
from node.storage.ledgers import LedgerStorage
from node.storage.readonly import ReadOnlySource

log = logging.getLogger(__name__)


RESERVE_FILE = "emergency-reserve"  # in data_dir


class EmergencyReserve:
    """The reserve file; every method blocks (call on a worker thread)."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self.path = settings.data_dir / RESERVE_FILE
        self.size = settings.disk_emergency_reserve_bytes
        self.held = False  # as last seen by make or release (for metrics, off the disk)

    def make(self) -> bool:
        """Allocate the reserve if the disk has room for it under the GC watermark."""
        self.held = self.path.exists()
        if self.size == 0 or self.held:
            return False
        stat = os.statvfs(self._settings.data_dir)
        total, free = stat.f_blocks * stat.f_frsize, stat.f_bavail * stat.f_frsize
        if not total or 1.0 - (free - self.size) / total >= self._settings.gc_disk_usage_threshold:
            return False
        tmp = self.path.with_name(RESERVE_FILE + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.posix_fallocate(fd, 0, self.size)  # real blocks, unlike a sparse truncate
            os.fsync(fd)
        except OSError as e:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            if is_no_space(e):
                return False
            raise
        os.close(fd)
        os.replace(tmp, self.path)
        fsync_dir(self.path.parent)
        self.held = True
        log.info("made the emergency reserve %s (%d bytes)", self.path, self.size)
        return True

    def release_if_full(self) -> bool:
        """Before the node opens its index: RocksDB must write to open (its WAL into a
        table file), and a disk filled while the node was down would keep it down."""
        if usage(self._settings.data_dir) > self._settings.disk_usage_threshold:
            return self.release()
        return False

    def release(self) -> bool:
        if not self.path.exists():
            return False
        self.path.unlink()
        fsync_dir(self.path.parent)
        self.held = False
        log.warning(
            "released the emergency reserve (%d bytes) so that the index and GC can free space",
            self.size,
        )
        return True


class DiskMonitor:
    def __init__(
        self,
        storage: LedgerStorage,
        gc: GarbageCollector,
        clock: Clock,
        measure: Callable[[Path], float] = usage,
    ) -> None:
        self._storage = storage
        self._gc = gc
        self._clock = clock
        self._settings = storage.settings
        self._measure = measure
        self.reserve = EmergencyReserve(self._settings)
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
        self._gc.disk_pressure = worst > s.gc_disk_usage_threshold
        if self._gc.disk_pressure:
            self._gc.request()
        self.warned = worst > s.disk_usage_warn_threshold
        if self.warned:
            log.warning("disk of %s is %.1f%% full", worst_dir, worst * 100)
        full = self._storage.read_only_source(ReadOnlySource.DISK)
        if worst > s.disk_usage_threshold and not full:
            self._storage.set_read_only(
                f"disk of {worst_dir} is {worst:.1%} full (limit {s.disk_usage_threshold:.0%})",
                ReadOnlySource.DISK,
            )
            self._gc.disk_full = True
            self._gc.request()
        elif full and worst < s.disk_usage_lwm_threshold:
            # Whoever set it: this monitor, or the storage when a write found no space.
            self._storage.set_read_only(None, ReadOnlySource.DISK)
            self._gc.disk_full = False
        elif full and not self._gc.disk_full:
            # The storage turned read-only itself (ENOSPC before the full watermark: a
            # burst, a quota, another tenant of the disk): GC runs now, as above.
            self._gc.disk_full = True
            self._gc.request()

    async def check(self) -> None:
        self.apply(await asyncio.to_thread(self.measure))
        await asyncio.to_thread(
            self._tend_free_space, self._storage.read_only_source(ReadOnlySource.DISK)
        )

    def _tend_free_space(self, out_of_space: bool) -> None:
        if out_of_space:
            self.reserve.release()
            dropped = kept.prune(self._settings.audit_snapshots_dir, 0)
            if dropped:
                log.warning(
                    "deleted %d audit snapshots for want of space (with them their hold "
                    "on entry logs GC deleted)",
                    len(dropped),
                )
        else:
            self.reserve.make()

    async def run_forever(self) -> None:
        interval = self._settings.disk_check_interval_ms / 1000
        while True:
            try:
                await self.check()
            except OSError:
                log.exception("disk check failed")
            await self._clock.sleep(interval)
