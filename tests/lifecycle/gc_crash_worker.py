"""Run one forced major compaction on a data dir, to be killed in the middle.

Usage: python -m tests.lifecycle.gc_crash_worker DATA_DIR CRASH_POINT|- RATE_BYTES_PER_S
Prints "compacting" once the run starts, "done" at the end.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from node.lifecycle.gc import GarbageCollector
from node.storage.clock import SystemClock
from node.storage.ledgers import LedgerStorage
from tests.lifecycle.gc_world import gc_settings


async def main(data_dir: Path, crash_point: str, rate: int) -> None:
    settings = gc_settings(
        data_dir,
        crash_points=frozenset() if crash_point == "-" else frozenset({crash_point}),
        is_throttle_by_bytes=True,
        compaction_rate_by_bytes=rate,
    )
    storage = LedgerStorage(settings)
    await storage.start()
    gc = GarbageCollector(storage, SystemClock())
    gc.request(force_major=True)
    print("compacting", flush=True)
    await gc.run()
    print("done", flush=True)
    await storage.close()


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])))
