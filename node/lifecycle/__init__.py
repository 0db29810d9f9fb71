"""Background work on the storage's public API: garbage collection and disk watermarks
(retention and offload join them in their issues)."""

from __future__ import annotations

import asyncio

from node.lifecycle.disks import DiskMonitor
from node.lifecycle.gc import GarbageCollector
from node.storage.clock import SystemClock
from node.storage.ledgers import LedgerStorage


class BackgroundWork:
    def __init__(self, storage: LedgerStorage) -> None:
        self.gc = GarbageCollector(storage, SystemClock())
        self.disks = DiskMonitor(storage, self.gc)
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        await self.disks.check()  # a node that starts on a full disk starts read-only
        self._tasks = [
            asyncio.create_task(self.gc.run_forever(), name="gc"),
            asyncio.create_task(self.disks.run_forever(), name="disk-monitor"),
        ]

    async def stop(self) -> None:
        gc_task, disk_task = self._tasks
        disk_task.cancel()
        self.gc.stop()
        await asyncio.gather(gc_task, disk_task, return_exceptions=True)
