"""The raw-device WAL (AutoMQ's Delta WAL): a ring of blocks on a block device or a file,
written with O_DIRECT, in place of the file journal (``wal_kind = "blockdev"``).

The bytes on the medium (the header slots, records, blocks' alignment) are ringformat.py's;
reading the ring back (recovery, ``inspect``) is ringscan.py's. This module is the writer.

Blocks. Records are packed back to back into blocks; a block starts 4 KiB aligned, is zero
padded to a 4 KiB multiple and is written with one O_DIRECT ``pwrite`` from a page-aligned
buffer. A block closes at ``wal_block_soft_limit`` bytes (a single larger record gets a block
of its own), or when it can be written: an I/O thread is free (or will be: one block may
wait queued per thread), the sliding window and the ring have room, and the write rate
limit allows (``wal_write_rate_limit`` blocks/s: a block closes 1/3000 s after the previous
one by default, AutoMQ's time threshold for a gp3 volume's 3,000 IOPS; 0 = none).
Meanwhile appends keep filling it: under load, blocks grow; when idle, an append is written
at once. ``wal_io_depth`` threads write blocks, each with one ``pwrite``. How a block becomes
durable (``wal_sync_mode``, unless ``wal_volatile_write_cache`` is off and the medium takes
O_DIRECT: the page cache is a volatile cache whatever the device has): ``fdatasync`` (the
default), one more thread fdatasyncs, each flush covering every write that completed before
it began while the next writes go on; ``dsync``, the medium is opened with O_DSYNC, so each
``pwrite`` returns once its block is durable and each I/O thread completes its own blocks
(fio's ``sync=dsync``, from threads: fewer IOPS, as every write waits for a flush of its
own, but a lower latency at a moderate rate on some media; docs/benchmarks.md has the figures).
Acknowledgments (the append futures, one shared per block) complete strictly in offset
order, whatever order the blocks become durable in: the acknowledged records are always a
contiguous prefix. A record that does not fit before the physical end is
preceded by a padding record (a block of its own) that fills the ring to its end; records
never straddle it.

Sliding window: a block is written only if it ends within ``window`` bytes of the first block
not yet durable (``window = wal_io_depth x the largest block``, kept in the header), so every
write that may have landed lies within ``window`` of the first hole a crash leaves.

Trim: ``checkpoint_complete(mark)`` moves the trim offset to the checkpoint's mark and writes
the header; only once that header is durable may blocks reuse the space ("flushed trim"), so a
crash never finds live records overwritten. When the ring has no room for the next block, or
is half full, the WAL asks the engine for a checkpoint (``request_checkpoint``); appends wait
for it and fail with the retryable ``Backpressure`` after ``db_storage_max_throttle_time_ms``
(with every append queued behind them; none of their records is written).

Recovery (``recover``): read the header slots (the valid one with the higher sequence wins);
from the trim offset, read a record header: if valid, take the record and move to its end; if
not, move to the next 4 KiB boundary.

- After a graceful shutdown the header has the end offset: no block was in flight, so records
  fill the ring from the trim offset to it, back to back but for each block's zero tail.
  Anything else there (a hole, a record whose body fails its CRC, a damaged record header,
  even in the very last record) is corruption: the start is refused, naming the offset,
  unless ``skip_replay_journal_invalid_record`` (then the valid records around it are
  replayed). Blocks go on at the end offset: nothing was ever written past it.
- After a crash (or a graceful stop while records a crash left were still untrimmed: their
  holes and torn tail are still there, so the header gives no end offset), an invalid record
  at a block boundary is a hole (a block in flight, never written) or the end; scanning stops
  once ``window`` bytes past the first such hole held nothing valid. Records found past a
  hole are returned too (they are durable, merely never acknowledged). Blocks go on one full
  ring past the trim offset, so that nothing left on the medium can ever pass for a record
  of the new lap.

Recovered records keep their space until the engine's first checkpoint trims them (if
recovery found none, the WAL trims at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import os
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from node.settings import Settings
from node.storage.clock import Clock
from node.storage.directio import (
    RawFile,
    aligned_buffer,
    create_file,
    open_raw,
    write_exactly,
)
from node.storage.errors import (
    Backpressure,
    CorruptRecord,
    EntryTooLarge,
    JournalFailed,
    WalDeviceError,
)
from node.storage.faults import Faults
from node.storage.journalformat import max_record_length
from node.storage.probe import NullProbe, StorageProbe
from node.storage.ringformat import (
    BLOCK_ALIGNMENT,
    BODY_PREFIX,
    DATA_MAGIC,
    HEADER_AREA,
    HEADER_SIZE,
    HEADER_SLOT_SIZE,
    HEADER_SLOTS,
    NO_INSTANCE,
    PADDING_MAGIC,
    RECORD_HEADER_SIZE,
    RECORD_OVERHEAD,
    U64_LIMIT,
    Shutdown,
    WalHeader,
    align_up,
    encode_header,
    encode_record_header,
    largest_block,
    minimum_capacity,
)
from node.storage.ringscan import (
    RingReader,
    RingScan,
    ScanEvent,
    ScanKind,
    SlotState,
    read_slots,
    restart_offset,
    scan_stop,
    winning_slot,
)
from node.storage.wal import LogMark, Replayed, WalRecord, failure_of, replay_runs

log = logging.getLogger(__name__)

# Fresh rings start at a random lap (a multiple of the ring size below this many laps), so
# that records a previous ring left on a reused device carry offsets of other laps.
FRESH_LAPS = 1 << 20
CHECKPOINT_AT_FILL = 0.5  # ask for a checkpoint once this share of the ring is unreclaimed
EXPIRY_RECHECK_S = 0.001  # a refusal due while blocks before it are in flight waits this long
# Blocks queued for each I/O thread besides the one it writes: a thread that finishes finds
# its next block at once instead of waiting for the event loop to hand one over (measured:
# 4 KiB blocks, 12k -> 18k writes/s on a loop device and on a file).
QUEUED_PER_THREAD = 1
MAX_HOLES_LOGGED = 5  # holes after which recovery logs only a count


# --- the writer ----------------------------------------------------------------------------


class _Block:
    """Records written with one I/O; every append into it shares its future."""

    __slots__ = (
        "buffer",
        "durable",
        "end",
        "error",
        "first_at",
        "future",
        "limit",
        "payload_bytes",
        "records",
        "size",
        "start",
        "used",
        "write_seconds",
    )

    def __init__(
        self,
        start: int,
        limit: int,
        buffer: mmap.mmap,
        future: asyncio.Future[LogMark],
        first_at: float,
    ) -> None:
        self.start = start  # logical offset, block aligned
        self.limit = limit  # bytes it may hold
        self.buffer: mmap.mmap | None = buffer
        self.future = future
        self.first_at = first_at  # when its first append came (for the full-ring wait)
        self.used = 0
        self.size = 0  # bytes written (set when sealed)
        self.end = start  # logical offset of the next block (set when sealed)
        self.records = 0
        self.payload_bytes = 0
        self.durable = False
        self.error: BaseException | None = None
        self.write_seconds = 0.0


class _Buffers:
    """Aligned block buffers, reused: a fresh anonymous mmap costs a page fault (and the
    kernel zeroing a page) for every page written into it, and an munmap after."""

    def __init__(self, size: int, keep_bytes: int) -> None:
        self._size = size  # the usual block's size: no buffer is smaller
        self._keep_bytes = keep_bytes  # free buffers kept, in bytes
        self._free: list[mmap.mmap] = []
        self._free_bytes = 0

    def take(self, size: int) -> mmap.mmap:
        free = self._free
        for i in range(len(free) - 1, -1, -1):
            if len(free[i]) >= size:
                buffer = free.pop(i)
                self._free_bytes -= len(buffer)
                return buffer
        return aligned_buffer(max(size, self._size))

    def give(self, buffer: mmap.mmap) -> None:
        if self._free_bytes + len(buffer) <= self._keep_bytes:
            self._free.append(buffer)
            self._free_bytes += len(buffer)
        else:
            buffer.close()

    def close(self) -> None:
        while self._free:
            self._free.pop().close()
        self._free_bytes = 0


def _no_checkpoint_requests() -> None:
    """Without an engine (tests, tools), nobody checkpoints on request."""


class _SharedFuture(asyncio.Future[LogMark]):
    """The future every append of a block shares. It refuses cancellation: a task awaiting
    it that is cancelled (a client gone, a timeout) would otherwise cancel it for every other
    append of the block, durable or not. Such a task is cancelled once the block is done."""

    def cancel(self, msg: Any = None) -> bool:
        return False


class BlockWal:
    """The ring (see the module docstring). State lives on the event loop; the device is
    touched by the I/O threads, the sync thread, and (header, recovery) by whoever calls
    ``last_mark``, ``recover`` and ``checkpoint_complete``."""

    def __init__(
        self,
        settings: Settings,
        clock: Clock,
        faults: Faults,
        probe: StorageProbe | None = None,
        request_checkpoint: Callable[[], None] | None = None,
        rng: random.Random | None = None,
        instance_id: Callable[[], bytes] | None = None,
    ) -> None:
        self._read_instance_id = instance_id
        if settings.wal_path is None:
            raise WalDeviceError("wal_kind=blockdev needs wal_path (NODE_WAL_PATH)")
        self._settings = settings
        self._path = Path(settings.wal_path)
        self._clock = clock
        self._faults = faults
        self._pwrite = faults.pwrite("blockwal.write", BLOCK_ALIGNMENT)
        self._sync = faults.sync("blockwal.fsync")
        self._probe: StorageProbe = probe or NullProbe()
        self._request_checkpoint = request_checkpoint or _no_checkpoint_requests
        self._rng = rng or random.Random()
        self._capacity = settings.wal_capacity
        self._area = self._capacity - HEADER_AREA
        self._soft_limit = align_up(settings.wal_block_soft_limit)
        self._io_depth = settings.wal_io_depth
        self._handed_max = self._io_depth * (1 + QUEUED_PER_THREAD)  # handed over, unwritten
        # How a block reaches stable storage: with O_DSYNC each pwrite returns once it is there
        # (each I/O thread completes its own blocks: fio's sync=dsync); else one more thread
        # fdatasyncs batches of completed writes. Neither without a volatile write cache.
        volatile = settings.wal_volatile_write_cache
        self._dsync = volatile and settings.wal_sync_mode == "dsync"
        self._fdatasync = volatile and settings.wal_sync_mode == "fdatasync"
        largest = largest_block(settings)
        self._window = min(self._io_depth * largest, self._area)
        self._max_record = RECORD_OVERHEAD + max_record_length(settings)
        rate = settings.wal_write_rate_limit
        self._rate_interval = 1.0 / rate if rate else 0.0
        self._rate_burst = self._rate_interval * (self._io_depth - 1)
        self._throttle_s = settings.db_storage_max_throttle_time_ms / 1000
        self._check_settings()

        self._raw: RawFile | None = None
        self.fdatasyncs = 0  # by the sync thread, one per batch of completed writes
        self._header: WalHeader | None = None
        self._fresh = False  # no ring on the medium before this process
        self._recovered: int | None = None  # records a complete recovery returned
        self._restart_at: int | None = None  # where blocks go on, once recovery has run
        self._recovered_intact = False  # recovery found exactly the records the header vouched
        # Below this offset the ring may hold what a crash left (holes, a torn tail): until
        # the trim passes it, a graceful shutdown cannot vouch for what follows the trim.
        self._leftovers_below = 0
        self._header_lock = threading.Lock()
        self._header_buffer: mmap.mmap | None = None
        self._instance_id = NO_INSTANCE  # the cookie's, written into every header
        self._sequence = 0
        self._trim = 0  # trim offset asked for (written with the next header)
        self._flushed_trim = 0  # trim offset of the newest durable header

        self._loop: asyncio.AbstractEventLoop | None = None
        # Blocks not yet durable span at most the window: buffers for that many are enough.
        self._buffers = _Buffers(self._soft_limit, self._window)
        self._open: _Block | None = None  # the block taking appends
        self._pending: deque[_Block] = deque()  # sealed, not yet handed to a thread
        self._in_flight: deque[_Block] = deque()  # handed to a thread, not yet acknowledged
        self._submitted = 0  # blocks handed to the I/O threads, ever
        self._writes_done = [0] * self._io_depth  # blocks written, per I/O thread (its own)
        self._want_slot = False  # the loop waits for a write to finish (threads wake it)
        self._next = 0  # logical offset where the next block starts
        self._durable_end = 0  # every block before it is durable and acknowledged
        self._pump_scheduled = False
        self._rate_free_at = 0.0
        self._rate_timer: asyncio.TimerHandle | None = None
        self._expiry_timer: asyncio.TimerHandle | None = None
        self._checkpoint_requested = False
        self._accepting = False
        self._failed: BaseException | None = None
        self._writes: queue.SimpleQueue[_Block | None] = queue.SimpleQueue()
        self._written: queue.SimpleQueue[_Block | None] = queue.SimpleQueue()  # to fdatasync
        self._durable: deque[_Block] = deque()  # back from the threads, for the loop
        self._durable_posted = False  # the loop has been woken to take them
        self._threads: list[threading.Thread] = []
        self._sync_thread: threading.Thread | None = None
        # Figures for metrics, benchmarks and inspect.
        self.blocks_written = 0
        self.bytes_written = 0
        self.records_written = 0
        self.throttled_appends = 0  # appends whose block waited for room in the ring
        self.rejected_appends = 0  # appends refused after waiting the throttle time for room
        # Blocks starting below this offset have waited for room: every block there was when
        # the ring was last found full (they are written, or refused, in offset order).
        self._waited_below = 0

    def _check_settings(self) -> None:
        needed = minimum_capacity(self._settings)
        if self._capacity % BLOCK_ALIGNMENT or self._capacity < needed:
            raise WalDeviceError(
                f"wal_capacity={self._capacity} (NODE_WAL_CAPACITY) must be a multiple of "
                f"{BLOCK_ALIGNMENT} and at least {needed}: the header area and two of the "
                f"largest blocks (max_entry_size={self._settings.max_entry_size}); raise it "
                "or lower max_entry_size"
            )
        if self._settings.node_id >= U64_LIMIT:
            raise WalDeviceError(f"node_id {self._settings.node_id} does not fit the header")

    # --- opening ----------------------------------------------------------------------------

    def _ensure_open(self) -> RawFile:
        """Open the medium and read (or create) the header: blocking, once."""
        if self._raw is not None:
            return self._raw
        # The cookie check ran before the storage opened; the cookie never changes after.
        if self._read_instance_id is not None:
            self._instance_id = self._read_instance_id()
        path = self._path
        if not path.exists():
            if path.is_relative_to("/dev"):
                raise WalDeviceError(f"raw-device WAL {path} does not exist")
            log.info("creating the raw-device WAL file %s (%d bytes)", path, self._capacity)
            create_file(path, self._capacity)
        try:
            raw = open_raw(path, writable=True, dsync=self._dsync)
        except OSError as e:
            raise WalDeviceError(f"cannot open the raw-device WAL {path}: {e}") from e
        if not raw.direct and not (self._dsync or self._fdatasync):
            # Without O_DIRECT the page cache is a volatile write cache, whatever the device.
            log.warning(
                "%s: wal_volatile_write_cache=false holds for the device, not for the page "
                "cache this file system forces: blocks are fdatasync'ed before acknowledging",
                path,
            )
            self._fdatasync = True
        try:
            self._check_medium(raw)
            reader = RingReader(raw, self._capacity)
            try:
                states = read_slots(reader)
            finally:
                reader.close()
            self._header_buffer = aligned_buffer(HEADER_SLOT_SIZE)
            self._raw = raw
            self._adopt_header(states)
        except BaseException:
            raw.close()
            self._raw = None
            raise
        return raw

    def _check_medium(self, raw: RawFile) -> None:
        if BLOCK_ALIGNMENT % raw.logical_block_size:
            raise WalDeviceError(
                f"{raw.path}: logical block size {raw.logical_block_size} does not divide the "
                f"WAL's {BLOCK_ALIGNMENT}-byte blocks; use another device"
            )
        if raw.size < self._capacity:
            kind = "device" if raw.block_device else "file"
            raise WalDeviceError(
                f"raw-device WAL {raw.path}: the {kind} holds {raw.size} bytes, less than "
                f"wal_capacity={self._capacity} (NODE_WAL_CAPACITY); give it a larger "
                f"{kind}, or set wal_capacity to at most {raw.size - raw.size % BLOCK_ALIGNMENT}"
                " (possible only for a new ring: the capacity is fixed at creation)"
            )

    def _adopt_header(self, states: list[SlotState]) -> None:
        winner = winning_slot(states)
        if winner is None:
            if any(state.has_magic for state in states):
                problems = "; ".join(f"slot {s.slot}: {s.problem}" for s in states)
                raise CorruptRecord(
                    str(self._path),
                    0,
                    f"both WAL header slots are invalid ({problems}); the trim offset is "
                    "lost. To start a new, empty ring (losing what this one holds), zero its "
                    f"first {HEADER_AREA} bytes",
                )
            self._initialize()
            return
        header = winner.header
        assert header is not None
        if header.capacity != self._capacity:
            raise WalDeviceError(
                f"raw-device WAL {self._path} was created with capacity {header.capacity}, "
                f"but wal_capacity={self._capacity}: the capacity is fixed at creation. Set "
                f"NODE_WAL_CAPACITY={header.capacity} to use this ring; to make a new one "
                f"(its records are lost: stop the node gracefully first), zero the first "
                f"{HEADER_AREA} bytes of {self._path}"
            )
        for state in states:
            if state.header is None:
                log.warning(
                    "WAL header slot %d of %s is invalid (%s); slot %d (sequence %d) wins",
                    state.slot,
                    self._path,
                    state.problem,
                    winner.slot,
                    header.sequence,
                )
        self._header = header
        self._sequence = header.sequence
        self._trim = self._flushed_trim = header.trim

    def _initialize(self) -> None:
        """A new ring: the header goes down before anything else."""
        base = self._rng.randrange(1, FRESH_LAPS) * self._area
        log.info("no WAL header on %s: creating a ring of %d bytes", self._path, self._capacity)
        self._fresh = True
        self._trim = self._flushed_trim = base
        self._header = self._write_header(Shutdown.UNGRACEFUL)

    # --- header -----------------------------------------------------------------------------

    def _write_header(self, shutdown: Shutdown, end: int = 0) -> WalHeader:
        """Blocking: the header with the current trim, into the older slot, made durable."""
        raw = self._raw
        assert raw is not None and self._header_buffer is not None
        with self._header_lock:
            trim = self._trim
            header = WalHeader(
                capacity=self._capacity,
                trim=trim,
                sequence=self._sequence + 1,
                written_ms=self._clock.now_ms(),
                window=self._window,
                node_id=self._settings.node_id,
                shutdown=shutdown,
                end=end,
                instance_id=self._instance_id,
            )
            self._header_buffer[:HEADER_SIZE] = encode_header(header)
            with memoryview(self._header_buffer) as view:
                write_exactly(raw, view, (header.sequence % HEADER_SLOTS) * HEADER_SLOT_SIZE)
            if self._fdatasync:
                os.fdatasync(raw.fd)
            self._sequence = header.sequence
            self._header = header
        return header

    # --- recovery (blocking, before start) --------------------------------------------------

    def last_mark(self) -> LogMark:
        self._ensure_open()
        assert self._header is not None
        return LogMark(0, self._header.trim)

    def replay(self, mark: LogMark) -> Iterator[Replayed]:
        # The ring's CRC covers the record's body, not record_crc's bytes: none to reuse.
        return replay_runs(self.recover(mark))

    def recover(self, mark: LogMark) -> Iterator[WalRecord]:
        raw = self._ensure_open()
        header = self._header
        assert header is not None
        if self._fresh:
            self._recovered = 0
            return
        start = max(mark.offset, header.trim)  # space before the trim offset may be reused
        reader = RingReader(raw, self._capacity)
        stop = scan_stop(header)
        scan = RingScan(reader.read, self._capacity, start, header.window, stop)
        count = 0
        try:
            for event in scan:
                if event.kind is not ScanKind.RECORD:
                    if stop is not None and event.kind is not ScanKind.PADDING:  # damage
                        self._on_corruption(event, stop)
                    continue
                assert event.record is not None
                count += 1
                yield event.record
        finally:
            reader.close()
        for hole in scan.holes[:MAX_HOLES_LOGGED]:
            log.warning(
                "WAL %s: hole at offset %d (%s), records again from %d: a block in flight "
                "at the crash; the records after it were never acknowledged",
                self._path,
                hole.offset,
                hole.reason,
                hole.next_valid,
            )
        if len(scan.holes) > MAX_HOLES_LOGGED:
            log.warning("WAL %s: %d more holes", self._path, len(scan.holes) - MAX_HOLES_LOGGED)
        self._restart_at = restart_offset(header)
        self._recovered_intact = stop is not None and not scan.damage
        log.info(
            "WAL %s: recovered %d records from offset %d to %d (%s shutdown; stopped: %s)",
            self._path,
            count,
            start,
            scan.end,
            header.shutdown.name.lower(),
            scan.end_reason,
        )
        self._recovered = count

    def _on_corruption(self, damage: ScanEvent, stop: int) -> None:
        if not self._settings.skip_replay_journal_invalid_record:
            raise CorruptRecord(
                str(self._path),
                damage.offset,
                f"{damage.reason}, before offset {stop} where the records end after a "
                "graceful shutdown (no block was in flight): corruption; set "
                "skip_replay_journal_invalid_record=true to replay past it (losing what it held)",
            )
        log.error(
            "skipping corrupt WAL data %s at %d: %s", self._path, damage.offset, damage.reason
        )

    # --- start and stop ---------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        await asyncio.to_thread(self._prepare)
        self._loop = loop
        self._accepting = True
        self._probe.wal_ring(self)
        self._threads = [
            threading.Thread(target=self._write_blocks, args=(i,), name=f"wal-io-{i}", daemon=True)
            for i in range(self._io_depth)
        ]
        if self._fdatasync:
            self._sync_thread = threading.Thread(
                target=self._sync_blocks, name="wal-sync", daemon=True
            )
            self._threads.append(self._sync_thread)
        for thread in self._threads:
            thread.start()

    def _prepare(self) -> None:
        """Blocking: where the next block goes, and a header saying "ungraceful" from now on
        (on disk before any block, so a crash is always seen as one)."""
        self._ensure_open()
        assert self._header is not None
        if self._fresh:
            start = self._header.trim
        elif self._restart_at is not None:
            start = self._restart_at
            if self._recovered == 0:
                self._trim = start  # nothing recovered needs its space kept
        else:  # not recovered (so the end is unknown): a full ring ahead, as after a crash
            start = align_up(self._header.trim + self._area)
        if not (self._fresh or self._recovered_intact):
            self._leftovers_below = start
        self._write_header(Shutdown.UNGRACEFUL)
        self._flushed_trim = self._trim
        self._next = self._durable_end = start

    async def close(self) -> None:
        if self._loop is None:
            await asyncio.to_thread(self._close_medium, None)
            return
        self._accepting = False
        drained = await self._drain()
        for _ in range(self._io_depth):
            self._writes.put(None)
        for timer in (self._rate_timer, self._expiry_timer):
            if timer is not None:
                timer.cancel()
        threads, self._threads = self._threads, []
        end = 0
        if drained and self._failed is None:
            shutdown = Shutdown.GRACEFUL
            if self._trim >= self._leftovers_below:
                end = self._durable_end  # every block before it is durable, none after
        else:
            shutdown = Shutdown.UNGRACEFUL
        await asyncio.to_thread(self._stop_threads, threads, shutdown, end)
        self._buffers.close()
        self._loop = None

    async def _drain(self) -> bool:
        """Wait until every block is durable (a full ring waits for the final checkpoint's
        trim, up to the throttle time); False if some never were."""
        if self._failed is not None:
            return False
        if self._open is not None and self._open.used:
            self._seal_open()
        self._pump()
        deadline = self._clock.monotonic() + self._throttle_s
        while self._pending or self._in_flight:
            last = (self._pending or self._in_flight)[-1]
            remaining = deadline - self._clock.monotonic()
            if remaining <= 0:
                log.error("WAL close: %d blocks never became durable", len(self._pending))
                return False
            try:
                await asyncio.wait_for(asyncio.shield(last.future), remaining)
            except JournalFailed:
                return False
            except (Backpressure, TimeoutError):
                continue  # refused (and dropped), or still waiting for room: look again
        return True

    def _stop_threads(self, threads: list[threading.Thread], shutdown: Shutdown, end: int) -> None:
        for thread in threads:
            if thread is self._sync_thread:
                self._written.put(None)  # after every write: the I/O threads ended first
            thread.join()
        self._sync_thread = None
        self._close_medium(shutdown, end)

    def _close_medium(self, shutdown: Shutdown | None, end: int = 0) -> None:
        if self._raw is None:
            return
        try:
            if shutdown is not None:
                self._write_header(shutdown, end)
        finally:
            self._raw.close()
            self._raw = None
            if self._header_buffer is not None:
                self._header_buffer.close()
                self._header_buffer = None

    # --- appends ----------------------------------------------------------------------------

    def append(
        self, ledger_id: int, entry_id: int, crc: int, payload: bytes
    ) -> asyncio.Future[LogMark]:
        if not self._accepting or self._failed is not None:
            raise JournalFailed(f"the WAL is not accepting appends: {self._failed or 'closed'}")
        body_length = BODY_PREFIX.size + len(payload)
        size = RECORD_HEADER_SIZE + body_length
        if size > self._max_record:
            raise EntryTooLarge(f"WAL record of {size} bytes exceeds {self._max_record}")
        block = self._open
        if block is None or block.used + size > block.limit:
            block = self._open_block(size)
        used = block.used
        buffer = block.buffer
        assert buffer is not None
        offset = block.start + used
        body_at = used + RECORD_HEADER_SIZE
        buffer[used:body_at] = encode_record_header(
            DATA_MAGIC, body_length, offset + RECORD_HEADER_SIZE, crc
        )
        BODY_PREFIX.pack_into(buffer, body_at, ledger_id, entry_id)
        buffer[body_at + BODY_PREFIX.size : used + size] = payload
        block.used = used + size
        block.records += 1
        block.payload_bytes += len(payload)
        if block.used >= self._soft_limit:
            self._seal_open()
        if not self._pump_scheduled:
            self._pump_scheduled = True
            assert self._loop is not None
            self._loop.call_soon(self._pump)
        return block.future

    def append_batch(
        self, ledger_id: int, first_entry_id: int, crcs: list[int], payloads: list[bytes]
    ) -> asyncio.Future[LogMark]:
        """Record by record (a batch may span blocks; blocks complete in order, so the
        last one's future covers the batch)."""
        future = None
        for n, (crc, payload) in enumerate(zip(crcs, payloads, strict=True)):
            future = self.append(ledger_id, first_entry_id + n, crc, payload)
        assert future is not None, "an empty batch"
        return future

    def _open_block(self, size: int) -> _Block:
        """A new block for a record of ``size`` bytes (after a padding block if the record
        does not fit before the physical end)."""
        if self._open is not None:
            self._seal_open()
        loop = self._loop
        assert loop is not None
        now = self._clock.monotonic()
        start = self._next
        to_end = self._area - start % self._area
        if size > to_end:
            self._pad_to_end(start, to_end, now)
            start += to_end
            to_end = self._area
        limit = min(max(self._soft_limit, align_up(size)), to_end)
        block = _Block(start, limit, self._buffers.take(limit), _SharedFuture(loop=loop), now)
        self._open = block
        return block

    def _pad_to_end(self, start: int, to_end: int, now: float) -> None:
        loop = self._loop
        assert loop is not None
        block = _Block(
            start, to_end, self._buffers.take(BLOCK_ALIGNMENT), _SharedFuture(loop=loop), now
        )
        assert block.buffer is not None
        header = encode_record_header(
            PADDING_MAGIC, to_end - RECORD_HEADER_SIZE, start + RECORD_HEADER_SIZE, 0
        )
        block.buffer[: len(header)] = header
        block.buffer[len(header) : BLOCK_ALIGNMENT] = bytes(BLOCK_ALIGNMENT - len(header))
        block.used = block.size = BLOCK_ALIGNMENT  # only the padding header is written
        block.end = start + to_end
        self._next = block.end
        self._pending.append(block)

    def _seal_open(self) -> None:
        block = self._open
        assert block is not None
        self._open = None
        if not block.used:
            assert block.buffer is not None
            self._buffers.give(block.buffer)
            return
        block.size = align_up(block.used)
        assert block.buffer is not None
        block.buffer[block.used : block.size] = bytes(block.size - block.used)
        block.end = block.start + block.size
        self._next = block.end
        self._pending.append(block)

    def _schedule_pump(self) -> None:
        self._rate_timer = None
        self._pump()

    def _pump(self) -> None:
        """Hand blocks to the I/O threads while a thread, the window, the ring and the rate
        limit allow; the block taking appends goes too when it could, else it keeps filling."""
        self._pump_scheduled = False
        if self._failed is not None:
            return
        while True:
            if self._writing() >= self._handed_max:
                # Flag first, then look again: a thread finishing in between sees the flag.
                self._want_slot = True
                if self._writing() >= self._handed_max:
                    break
                self._want_slot = False
            if self._pending:
                block = self._pending[0]
                end = block.end
            elif self._open is not None and self._open.used:
                block = self._open
                end = block.start + align_up(block.used)
            else:
                break
            window_start = self._in_flight[0].start if self._in_flight else block.start
            if end - window_start > self._window:
                break
            if end > self._flushed_trim + self._area:
                self._on_ring_full()
                break
            if self._rate_interval:
                now = self._clock.monotonic()
                if now < self._rate_free_at:
                    if self._rate_timer is None:
                        assert self._loop is not None
                        self._rate_timer = self._loop.call_later(
                            self._rate_free_at - now, self._schedule_pump
                        )
                    break
                self._rate_free_at = (
                    max(self._rate_free_at, now - self._rate_burst) + self._rate_interval
                )
            if block is self._open:
                self._seal_open()
            self._pending.popleft()
            if block.start < self._waited_below:
                self.throttled_appends += block.records
            self._in_flight.append(block)
            self._submitted += 1
            self._writes.put(block)
        # Half the ring durable and not yet trimmed: a checkpoint now (it can trim only what
        # is durable) keeps appends from ever waiting for one.
        if not self._checkpoint_requested and (
            self._durable_end - self._flushed_trim >= self._area * CHECKPOINT_AT_FILL
        ):
            self._ask_for_checkpoint()

    def _writing(self) -> int:
        """Blocks handed to the I/O threads and not yet written (written ones wait only for
        the next flush, which does not hold a thread)."""
        return self._submitted - sum(self._writes_done)

    def _ask_for_checkpoint(self) -> None:
        self._checkpoint_requested = True
        self._request_checkpoint()

    def _on_ring_full(self) -> None:
        self._waited_below = self._next + (1 if self._open is not None else 0)
        if not self._checkpoint_requested:
            self._ask_for_checkpoint()
        if self._expiry_timer is None:
            assert self._loop is not None
            self._expiry_timer = self._loop.call_later(self._throttle_s, self._expire)

    def _blocked(self) -> list[_Block]:
        """Blocks that wait for ring space: the first that does not fit, every block after
        it, and the one taking appends."""
        limit = self._flushed_trim + self._area
        blocked: list[_Block] = []
        for block in self._pending:
            if blocked or block.end > limit:
                blocked.append(block)
        taking = self._open
        if (
            taking is not None
            and taking.used
            and (blocked or taking.start + align_up(taking.used) > limit)
        ):
            blocked.append(taking)
        return blocked

    def _expire(self) -> None:
        """Appends that waited the throttle time for ring space are refused (Backpressure),
        and with them every block queued behind theirs, which could only be written after
        them: none of those records is ever written, so the engine forgets them as it does
        appends a full disk refused. Refused only once every block before them is
        acknowledged, so that a refusal always leaves a contiguous acknowledged prefix."""
        self._expiry_timer = None
        loop = self._loop
        if loop is None or self._failed is not None:
            return
        blocked = self._blocked()
        if not blocked:
            return
        first = blocked[0]
        now = self._clock.monotonic()
        due = first.first_at + self._throttle_s
        if now < due or first.start != self._durable_end:
            recheck = max(due - now, EXPIRY_RECHECK_S)
            self._expiry_timer = loop.call_later(recheck, self._expire)
            return
        refusal = Backpressure(
            "the raw-device WAL stayed full for db_storage_max_throttle_time_ms: no "
            "checkpoint freed space in time; retry later"
        )
        for block in blocked:
            if block is self._open:
                self._open = None
            else:
                self._pending.remove(block)
            if block.buffer is not None:
                self._buffers.give(block.buffer)
                block.buffer = None
            block.future.set_exception(refusal)
            block.future.exception()  # retrieved here; awaiting appends still get it
        self._next = self._waited_below = first.start
        refused = sum(block.records for block in blocked)
        self.throttled_appends += refused
        self.rejected_appends += refused
        log.warning(
            "raw-device WAL %s full for %.1f s: refused %d blocks of appends",
            self._path,
            self._throttle_s,
            len(blocked),
        )

    # --- I/O threads ------------------------------------------------------------------------

    def _write_blocks(self, index: int) -> None:
        """An I/O thread: one pwrite per block. Durable once written (O_DSYNC, or no volatile
        cache), a block goes straight back to the loop; else to the sync thread."""
        raw = self._raw
        loop = self._loop
        assert raw is not None and loop is not None
        area = self._area
        clock = time.perf_counter
        done = self._writes_done
        durable_when_written = not self._fdatasync
        while True:
            block = self._writes.get()
            if block is None:
                return
            try:
                assert block.buffer is not None
                began = clock()
                with memoryview(block.buffer) as whole, whole[: block.size] as data:
                    write_exactly(raw, data, HEADER_AREA + block.start % area, self._pwrite)
                block.write_seconds = clock() - began
            except BaseException as e:
                block.error = e
            done[index] += 1  # only this thread writes its counter
            if durable_when_written:
                if block.error is None:
                    # A flush, if any, was part of the write: none is timed apart.
                    self._probe.journal_write(block.records, block.size, block.write_seconds, 0.0)
                    self._probe.wal_block(block.size)
                if not self._hand_back((block,)):
                    return
                continue  # the loop, taking it back, hands this thread its next block
            self._written.put(block)
            if self._want_slot:
                self._want_slot = False
                with contextlib.suppress(RuntimeError):  # the loop is gone: nothing waits
                    loop.call_soon_threadsafe(self._pump)

    def _sync_blocks(self) -> None:
        """The sync thread: one fdatasync covers every write that completed before it."""
        raw = self._raw
        assert raw is not None
        written = self._written
        clock = time.perf_counter
        while True:
            block = written.get()
            if block is None:
                return
            batch = [block]
            with contextlib.suppress(queue.Empty):
                while True:
                    more = written.get_nowait()
                    if more is None:
                        written.put(None)  # after this batch
                        break
                    batch.append(more)
            sync_seconds = 0.0
            if any(b.error is None for b in batch):
                began = clock()
                try:
                    self._sync(raw.fd)
                except OSError as e:
                    for b in batch:
                        b.error = b.error or e
                sync_seconds = clock() - began
                self.fdatasyncs += 1  # only this thread writes it
            good = [b for b in batch if b.error is None]
            if good:
                self._probe.journal_write(
                    sum(b.records for b in good),
                    sum(b.size for b in good),
                    max(b.write_seconds for b in good),
                    sync_seconds,
                )
                for b in good:
                    self._probe.wal_block(b.size)
            if not self._hand_back(batch):
                return

    def _hand_back(self, blocks: Iterable[_Block]) -> bool:
        """From a thread: blocks durable (or failed) go back to the loop, which one wake-up
        serves for all that come back before it runs. False once the loop is gone."""
        self._durable.extend(blocks)
        if self._durable_posted:
            return True  # its wake-up is still to run, and takes these too
        self._durable_posted = True
        loop = self._loop
        assert loop is not None
        try:
            loop.call_soon_threadsafe(self._on_durable)
        except RuntimeError:  # the loop is gone (a process ending without close())
            return False
        return True

    def _on_durable(self) -> None:
        """Back on the loop: acknowledge, in offset order, every block now durable."""
        self._durable_posted = False  # first: a block handed back from now on wakes it again
        returned = self._durable
        while returned:
            block = returned.popleft()
            if block.error is not None:
                self._fail(block.error)
                return
            block.durable = True
            if block.buffer is not None:
                self._buffers.give(block.buffer)
                block.buffer = None
        in_flight = self._in_flight
        while in_flight and in_flight[0].durable:
            block = in_flight.popleft()
            self._durable_end = block.end
            self.blocks_written += 1
            self.bytes_written += block.size
            self.records_written += block.records
            if not block.future.done():
                block.future.set_result(LogMark(0, block.end))
        self._pump()

    def _fail(self, error: BaseException) -> None:
        if self._failed is not None:
            return
        self._failed = error
        log.error("raw-device WAL write failed; the node stops acknowledging: %s", error)
        failure = JournalFailed(f"raw-device WAL write failed: {error}")
        blocks = [*self._in_flight, *self._pending]
        if self._open is not None:
            blocks.append(self._open)
        for block in blocks:
            if not block.future.done():
                block.future.set_exception(failure)
                block.future.exception()  # retrieved here; awaiting appends still get it

    # --- sync points and checkpoints --------------------------------------------------------

    def _done(self, mark: LogMark) -> asyncio.Future[LogMark]:
        future: asyncio.Future[LogMark] = asyncio.get_running_loop().create_future()
        if self._failed is not None:
            future.set_exception(JournalFailed(f"raw-device WAL write failed: {self._failed}"))
        else:
            future.set_result(mark)
        return future

    def sync_point(self) -> asyncio.Future[LogMark]:
        """Close the block taking appends; a future for the newest block (every append so far
        is durable when it completes)."""
        if self._open is not None and self._open.used:
            self._seal_open()
            self._pump()
        newest = self._pending or self._in_flight
        if newest and self._failed is None:
            return newest[-1].future
        return self._done(LogMark(0, self._durable_end))

    def checkpoint_point(self) -> asyncio.Future[LogMark]:
        """Like ``sync_point``, but the mark stops before blocks that wait for ring space:
        their records are in the checkpoint's cache already, and waiting for them would wait
        for this very checkpoint's trim."""
        if self._open is not None and self._open.used:
            self._seal_open()
            self._pump()
        limit = self._flushed_trim + self._area
        before: _Block | None = self._in_flight[-1] if self._in_flight else None
        for block in self._pending:
            if block.end > limit:
                break
            before = block
        if before is not None and self._failed is None:
            return before.future  # completes, in order, with the mark of its end
        return self._done(LogMark(0, self._durable_end))

    def trim(self, offset: int) -> None:
        """Records before ``offset`` are dead; the space is reused once a header carrying it
        is durable (the next checkpoint's)."""
        self._trim = max(self._trim, offset)

    def checkpoint_complete(self, mark: LogMark) -> None:
        """Blocking (the checkpoint thread): trim to ``mark``, write the header; then the
        space is reusable."""
        self.trim(mark.offset)
        self._faults.hit("blockwal.trim.before_header")
        header = self._write_header(Shutdown.UNGRACEFUL)
        self._faults.hit("blockwal.trim.after_header")
        loop = self._loop
        if loop is None:
            self._flushed_trim = header.trim
        else:
            loop.call_soon_threadsafe(self._on_trim_durable, header.trim)

    def _on_trim_durable(self, trim: int) -> None:
        self._flushed_trim = max(self._flushed_trim, trim)
        self._checkpoint_requested = False  # a checkpoint ran: ask again if still needed
        self._pump()

    # --- introspection ----------------------------------------------------------------------

    @property
    def queued_bytes(self) -> int:
        """Bytes appended and not yet handed to an I/O thread."""
        queued = sum(b.used for b in self._pending)
        return queued + (self._open.used if self._open else 0)

    @property
    def failure(self) -> str | None:
        return failure_of(self._failed)

    @property
    def durable_offset(self) -> int:
        return self._durable_end

    @property
    def ring_bytes(self) -> int:
        """Room for records: the capacity less the header area."""
        return self._area

    @property
    def ring_used_bytes(self) -> int:
        """Bytes from the durable trim offset to the end of the newest block (the one taking
        appends included); a ring that blocks wait for counts as full."""
        taking = self._open
        end = taking.start + align_up(taking.used) if taking is not None else self._next
        return max(0, min(self._area, end - self._flushed_trim))

    @property
    def blocks_in_flight(self) -> int:
        """Blocks handed to the I/O threads and not yet acknowledged."""
        return len(self._in_flight)

    @property
    def trim_offset(self) -> int:
        return self._flushed_trim

    @property
    def direct_io(self) -> bool:
        return self._raw is not None and self._raw.direct
