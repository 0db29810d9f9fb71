"""A writer process for the SIGKILL test of the raw-device WAL (run with ``sys.executable``).

Arguments: device or file, ring capacity, trial number, data dir, ``wal_sync_mode``.
Recovers the ring (as the node does at start), then appends records of random sizes from
several coroutines until it is killed, and checkpoints whenever the ring asks (the records
count as safe elsewhere once trimmed). Every line of stdout is flushed at once:

    ready                        started: appends begin
    ack <seq> <size> <mark>      record <seq> (ledger id = the trial) is durable; its block
                                 ends at logical offset <mark>
    trimming <offset>            a header with this trim offset is being written ...
    trim <offset>                ... and is durable

The payload of record (trial, seq) is ``payload(trial, seq, size)``: the parent rebuilds it.
"""

from __future__ import annotations

import asyncio
import random
import sys
from pathlib import Path

from node.settings import Settings, load
from node.storage.blockwal import BlockWal
from node.storage.clock import SystemClock
from node.storage.errors import Backpressure
from node.storage.faults import Faults
from node.storage.wal import record_crc

WRITERS = 8  # appends in flight at once
MAX_ENTRY = 32 * 1024
SMALL_ENTRY = 512  # half the records are at most this large, half up to MAX_ENTRY
SEQ_STRIDE = 1_000_003  # keeps the payload seeds of different trials apart


def payload(trial: int, seq: int, size: int) -> bytes:
    return random.Random(trial * SEQ_STRIDE + seq).randbytes(size)


def settings_for(path: Path, capacity: int, data_dir: Path, sync_mode: str) -> Settings:
    return load(
        data_dir=data_dir,
        wal_kind="blockdev",
        wal_path=path,
        wal_capacity=capacity,
        max_entry_size=MAX_ENTRY,
        wal_write_rate_limit=0,
        wal_sync_mode=sync_mode,
        db_storage_write_cache_max_size=4 * 1024 * 1024,
    )


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def main(path: Path, capacity: int, trial: int, data_dir: Path, sync_mode: str) -> None:
    wanted = asyncio.Event()
    wal = BlockWal(
        settings_for(path, capacity, data_dir, sync_mode),
        SystemClock(),
        Faults(),
        request_checkpoint=wanted.set,
    )
    mark = await asyncio.to_thread(wal.last_mark)
    await asyncio.to_thread(lambda: sum(1 for _ in wal.recover(mark)))
    await wal.start()
    say("ready")
    rng = random.Random(trial)
    next_seq = 0

    async def checkpointer() -> None:
        while True:
            await wanted.wait()
            wanted.clear()
            at = await wal.checkpoint_point()
            say(f"trimming {at.offset}")
            await asyncio.to_thread(wal.checkpoint_complete, at)
            say(f"trim {at.offset}")

    async def writer() -> None:
        nonlocal next_seq
        while True:
            seq = next_seq
            next_seq += 1
            limit = SMALL_ENTRY if rng.random() < 0.5 else MAX_ENTRY
            size = rng.randrange(0, limit + 1)
            data = payload(trial, seq, size)
            try:
                done = await wal.append(trial, seq, record_crc(trial, seq, data), data)
            except Backpressure:
                continue
            say(f"ack {seq} {size} {done.offset}")

    await asyncio.gather(checkpointer(), *(writer() for _ in range(WRITERS)))


if __name__ == "__main__":
    path, capacity, trial, data_dir, sync_mode = sys.argv[1:6]
    asyncio.run(main(Path(path), int(capacity), int(trial), Path(data_dir), sync_mode))
