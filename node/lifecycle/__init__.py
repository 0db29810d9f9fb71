"""Background work on the storage's public API: garbage collection, disk watermarks and
stream retention, tiered storage (node/offload)."""

from __future__ import annotations

import asyncio

from node.lifecycle.disks import DiskMonitor
from node.lifecycle.gc import GarbageCollector
from node.lifecycle.retention import Retention
from node.offload.service import FleetStreams, OffloadService
from node.storage.clock import Clock
from node.storage.fsutil import usage
from node.storage.ledgers import LedgerStorage
from node.streams.manager import StreamManager


class BackgroundWork:
    def __init__(
        self,
        storage: LedgerStorage,
        streams: StreamManager,
        clock: Clock,
        fleet: FleetStreams | None = None,
    ) -> None:
        self._settings = storage.settings
        self.gc = GarbageCollector(storage, clock)
        self.disks = DiskMonitor(storage, self.gc, clock)
        self.retention = Retention(
            streams, clock, lambda: max(usage(p) for p in self.disks.dirs().values()), fleet
        )
        self.offload = OffloadService(storage, streams, clock, fleet)
        self._tasks: list[asyncio.Task[None]] = []

    async def before_storage_start(self) -> None:
        await asyncio.to_thread(self.disks.reserve.release_if_full)

    async def start(self) -> None:
        await self.disks.check()  # a node that starts on a full disk starts read-only
        await self.offload.start()
        self._tasks = [
            asyncio.create_task(self.gc.run_forever(), name="gc"),
            asyncio.create_task(self.disks.run_forever(), name="disk-monitor"),
            asyncio.create_task(self.retention.run_forever(), name="retention"),
        ]
        if self._settings.offload_scheduler_enabled:
            self._tasks.append(asyncio.create_task(self.offload.run_forever(), name="offload"))

    async def stop(self) -> None:
        gc_task, *others = self._tasks
        for task in others:
            task.cancel()
        self.gc.stop()
        await asyncio.gather(gc_task, *others, return_exceptions=True)
