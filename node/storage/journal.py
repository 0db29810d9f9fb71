"""The file journal (BookKeeper's Journal, JournalChannel and LogMark).

The bytes on disk (file header, records, batches, group starts, padding, ``lastMark``) and
the record parser are journalformat.py's; this module writes and replays them.

Replay hands a batch record on whole (a ``BatchRecord``) and gathers single records of one
ledger at consecutive ids into runs (``EntryRun``, at most ``REPLAY_RUN_ENTRIES``, within one
file; a BatchRecord is an EntryRun too): the storage then works per run, not per entry,
whichever way the entries were added.

One writer task commits groups. By default (``journal_flush_when_queue_empty``) it writes
whenever it is idle and something is queued, and what arrives while a write is in flight
forms the next group, as PostgreSQL's WAL writer and Redis's ``appendfsync always`` do: a
lone add waits for one fsync, never for a timer, and groups grow with the load by
themselves. With that setting false, an idle writer waits until the group taking appends is
``journal_max_group_wait_ms`` old (BookKeeper's default). A group is also sealed when it
reaches ``journal_buffered_writes_threshold`` bytes (so the disk writes it while the next
one fills) or when a checkpoint asks for a sync point. A batch goes into one group whole.
Each write is one ``pwrite`` on a dedicated thread and one fdatasync; only then do the
groups' futures complete, each shared by every append of its group (no per-entry future or
callback on the hot path). After a write, that thread takes what was appended meanwhile and
writes it at once (``_write_on``), handing only the acknowledgments to the event loop: the
next write never waits for the loop to get round to starting it (with it, 16 clients of
single adds went from about 9,400 to 12,400 adds/s).

One write is in flight at a time. Two (the second's fdatasync covering both, acknowledged
in order) would keep the disk busier, but a crash could then leave the second write whole
behind a torn first one, which replay reads as corruption in the middle of the journal
(a valid group start after a bad record), not as a torn tail: the node would refuse to start
where today it cuts the tail.

A full disk (ENOSPC, EDQUOT) is not fatal: the write that found no space fails its groups
and every group queued behind it with DiskFull, leaves nothing of itself in the file, and
the next write tries again at the same offset; ``on_no_space`` lets the storage turn
read-only at once. Neither is a rotation that cannot create the next file for want of
space or of a descriptor (EMFILE, ENFILE, ENOMEM): the current file takes the next writes
and the rotation is retried after each. A failed fdatasync stays fatal (after one, the state
of the page cache is unknown: PostgreSQL's fsyncgate), and so does any other failed write
(which, like one that found no space, first zeroes what it had written): ``failure`` says
why, and the storage reports the node as not writable.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from node.settings import Settings
from node.storage.clock import Clock
from node.storage.errors import CorruptRecord, DiskFull, JournalFailed
from node.storage.faults import Faults, Pwrite
from node.storage.fsutil import (
    fsync_dir,
    is_no_space,
    is_out_of_resources,
    write_file_atomically,
)
from node.storage.journalformat import (
    GROUP_START_ENTRY_ID,
    HEADER_SIZE,
    LAST_MARK,
    LAST_MARK_FILE,
    NO_INSTANCE,
    PADDING_ENTRY_ID,
    RECORD_HEADER,
    RecordScan,
    decode_batch,
    decode_header,
    encode_batch,
    encode_group_start,
    encode_header,
    journal_path,
    judge_invalid,
    list_journals,
    max_record_length,
    padding,
    read_last_mark,
)
from node.storage.probe import NullProbe, StorageProbe
from node.storage.wal import (
    BATCH,
    REPLAY_RUN_ENTRIES,
    BatchRecord,
    EntryRun,
    LogMark,
    Replayed,
    WalRecord,
    failure_of,
)

log = logging.getLogger(__name__)

# How long the writer thread waits for the first record after a write before it hands back
# to the loop (``_wait_for_next``). Bounded so that a journal never closed (a process that
# exits without it) holds the interpreter's exit, which joins the thread, no longer.
IDLE_PARK_S = 0.5


def _batch(path: Path, pos: int, mm: mmap.mmap, end: int, ledger_id: int) -> BatchRecord:
    """The batch record at ``pos`` (its CRC checked), or CorruptRecord."""
    batch = decode_batch(mm, pos + RECORD_HEADER.size, end, ledger_id)
    if isinstance(batch, str):
        raise CorruptRecord(str(path), pos, f"{batch} (its CRC matches: it was written so)")
    return batch


def _pwrite_some(fd: int, data: memoryview, offset: int, pwrite: Pwrite = os.pwrite) -> int:
    """Bytes one pwrite wrote; an error rather than a loop that never ends."""
    done = pwrite(fd, data, offset)
    if done == 0:
        raise OSError(errno.EIO, f"pwrite of {len(data)} bytes at {offset} wrote nothing")
    return done


class _SharedFuture(asyncio.Future[LogMark]):
    """A group's future, awaited by every append of the group: cancelling one append (a
    timeout, a dropped request) must cancel only that append's task, never the future
    the others share. Task.cancel() asks the awaited future first; this one declines, and
    the task is cancelled at its next step all the same."""

    def cancel(self, msg: object = None) -> bool:
        return False


class _Group:
    """Records queued for one group commit; all of them share one future."""

    __slots__ = ("first_at", "future", "parts", "records", "size")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.parts: list[bytes] = []
        self.size = 0
        self.records = 0  # entries and metadata records
        self.first_at = 0.0
        self.future: asyncio.Future[LogMark] = _SharedFuture(loop=loop)


class _WriteFailed(Exception):
    """A write of ``_write_on`` failed: its groups (not those it was called with, which
    may be acknowledged already) and the error."""

    def __init__(self, groups: list[_Group], error: BaseException) -> None:
        super().__init__(str(error))
        self.groups = groups
        self.error = error


class Journal:
    def __init__(
        self,
        settings: Settings,
        clock: Clock,
        faults: Faults,
        probe: StorageProbe | None = None,
        on_no_space: Callable[[str], None] | None = None,
        instance_id: Callable[[], bytes] | None = None,
    ) -> None:
        self._settings = settings
        self._probe: StorageProbe = probe or NullProbe()
        self._read_instance_id = instance_id
        self._on_no_space = on_no_space  # called on the loop when a write finds no space
        self._clock = clock
        self._faults = faults
        self._pwrite = faults.pwrite("journal.write")
        self._fdatasync = faults.sync("journal.fsync")
        self._dir = settings.journal_dir
        self._fd = -1
        self._file_id = 0
        self._instance_id = NO_INSTANCE  # the cookie's, written into each new file's header
        self._position = 0
        self._preallocated = 0
        self._durable = LogMark(0, 0)
        self._failed: BaseException | None = None
        self._rotation_deferred = False  # the last rotation could not create its file
        self._group: _Group | None = None  # the group taking appends
        self._sealed: list[_Group] = []  # groups closed by sync_point(), not yet written
        self._kick: asyncio.Event | None = None
        self._writer: asyncio.Task[None] | None = None
        self._writing: asyncio.Future[LogMark] | None = None  # the group being written
        # While a write is in flight, its thread may take the groups queued meanwhile and
        # write them next (_write_on): the lock orders that against appends and seals.
        self._lock = threading.Lock()
        # The writer thread waits on this after a write for the next records (eager mode),
        # woken by the first one and once ``_wanted`` are queued.
        self._more = threading.Condition(self._lock)
        self._writer_waits = False
        self._wanted = 1
        self._last_sync_s = 0.0  # the last write's fdatasync took this long
        self._group_threshold = settings.journal_buffered_writes_threshold
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False
        # One thread: group writes must reach the file in order.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="journal-writer")
        # Figures for metrics and benchmarks.
        self.groups_written = 0
        self.bytes_written = 0

    # --- recovery (blocking, before start) -------------------------------------------------

    def last_mark(self) -> LogMark:
        return read_last_mark(self._settings.ledgers_dir)

    def recover(self, mark: LogMark) -> Iterator[WalRecord]:
        for record, _crc in self.replay(mark):
            if isinstance(record, EntryRun):
                yield from record.records()
            else:
                yield record

    def replay(self, mark: LogMark) -> Iterator[Replayed]:
        ids = [i for i in list_journals(self._dir) if i >= mark.log_id]
        if mark.log_id > 0 and (not ids or ids[0] != mark.log_id):
            raise CorruptRecord(
                str(journal_path(self._dir, mark.log_id)),
                mark.offset,
                "the journal named by lastMark is missing; restore it or remove lastMark "
                "to replay from the oldest journal",
            )
        for n, journal_id in enumerate(ids):
            start = mark.offset if journal_id == mark.log_id else HEADER_SIZE
            yield from self._scan_file(journal_id, max(start, HEADER_SIZE), last=n == len(ids) - 1)

    def _scan_file(self, journal_id: int, start: int, last: bool) -> Iterator[Replayed]:
        path = journal_path(self._dir, journal_id)
        max_length = max_record_length(self._settings)
        with open(path, "r+b") as f:
            size = os.fstat(f.fileno()).st_size
            if size < HEADER_SIZE:
                if last:  # a crash while the file was being created
                    return
                raise CorruptRecord(str(path), 0, "journal shorter than its header")
            cut: int | None = None
            with (
                mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm,
                memoryview(mm) as view,  # a batch's CRC is checked without copying it
            ):
                try:
                    decode_header(mm[:HEADER_SIZE])
                except ValueError as e:
                    if last and not any(mm[:HEADER_SIZE]):
                        return  # header never reached the disk: nothing was acknowledged
                    raise CorruptRecord(str(path), 0, f"bad journal header: {e}") from None
                # Single records of one ledger at consecutive ids (what single adds
                # journal) are gathered into runs, yielded as batches: replay's work is
                # then per run, as for a batch record, not per entry.
                run_ledger = run_first = 0
                run_next: int | None = None  # the entry id that extends the run, if any
                run_crcs: list[int] = []
                run_payloads: list[bytes] = []
                scan = RecordScan(mm, start, size, max_length, view)
                while True:
                    for at, end, ledger_id, entry_id, crc, payload in scan:
                        if (  # (an entry id: never a batch record's, nor padding's)
                            entry_id == run_next
                            and ledger_id == run_ledger
                            and len(run_payloads) < REPLAY_RUN_ENTRIES
                        ):
                            run_payloads.append(payload)
                            run_crcs.append(crc)
                            run_next = entry_id + 1
                            continue
                        if entry_id in (GROUP_START_ENTRY_ID, PADDING_ENTRY_ID):
                            continue  # a run goes on across group writes
                        if run_payloads:  # anything else ends the run first
                            yield EntryRun(run_ledger, run_first, run_crcs, run_payloads), None
                            run_next, run_crcs, run_payloads = None, [], []
                        if entry_id == BATCH:
                            yield _batch(path, at, mm, end, ledger_id), None
                        elif entry_id >= 0:
                            run_ledger, run_first = ledger_id, entry_id
                            run_next, run_crcs, run_payloads = entry_id + 1, [crc], [payload]
                        else:
                            yield WalRecord(ledger_id, entry_id, payload), crc
                    if scan.invalid is None:
                        break
                    later = self._on_invalid(path, mm, scan.end, size, scan.invalid, last)
                    if later is None:
                        cut = scan.end
                        break
                    scan = RecordScan(mm, later, size, max_length, view)
                if run_payloads:
                    yield EntryRun(run_ledger, run_first, run_crcs, run_payloads), None
            if cut is not None:
                os.ftruncate(f.fileno(), cut)
                os.fsync(f.fileno())

    def _on_invalid(
        self, path: Path, mm: mmap.mmap, pos: int, size: int, reason: str, last: bool
    ) -> int | None:
        """Where replay goes on after an invalid record at ``pos``: None for a torn tail,
        to be cut off; else the next write (only if skipping corruption is allowed)."""
        invalid = judge_invalid(
            mm,
            pos,
            reason,
            size,
            newest=last,
            alignment=self._settings.journal_alignment_size,
            max_length=max_record_length(self._settings),
        )
        if invalid.torn:
            log.warning("cutting torn journal tail %s at %d (%s)", path, pos, reason)
            return None
        later = invalid.later
        if not self._settings.skip_replay_journal_invalid_record:
            where = "with a later write after it" if later else "in a journal that is not the last"
            raise CorruptRecord(
                str(path),
                pos,
                f"{reason}, {where}; set skip_replay_journal_invalid_record=true to replay "
                "past it (losing what it held)",
            )
        log.error("skipping corrupt journal data %s at %d: %s", path, pos, reason)
        return later if later is not None else size

    # --- writing ---------------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self._open_next_file)
        self._durable = LogMark(self._file_id, self._position)
        self._group = _Group(loop)
        self._loop = loop
        self._kick = asyncio.Event()
        self._writer = loop.create_task(self._write_loop(), name="journal-writer")

    def _open_next_file(self) -> None:
        # Read once, at start: the cookie check ran before and never changes it while we run.
        if self._read_instance_id is not None:
            self._instance_id = self._read_instance_id()
        existing = list_journals(self._dir)
        self._open_file(existing[-1] + 1 if existing else 1)

    def _open_file(self, journal_id: int) -> None:
        try:
            self._create_file(journal_id, self._settings.journal_pre_alloc_size)
        except OSError as e:
            if not is_no_space(e):
                raise
            # A full disk at start or rotation: begin with the header's sector alone.
            # Each write then extends the file, and one that finds no space is refused.
            self._drop_backups()
            self._create_file(journal_id, self._settings.journal_alignment_size)

    def _create_file(self, journal_id: int, preallocate: int) -> None:
        self._dir.mkdir(parents=True, exist_ok=True)
        path = journal_path(self._dir, journal_id)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.posix_fallocate(fd, 0, preallocate)
            os.pwrite(fd, encode_header(self._instance_id), 0)
            os.fdatasync(fd)
            fsync_dir(self._dir)
        except BaseException:
            os.close(fd)
            # A rotation that found no space tries this id again (O_EXCL), and a file
            # without its header followed by a newer journal would stop the next replay.
            with contextlib.suppress(OSError):
                path.unlink()
                fsync_dir(self._dir)
            raise
        self._fd, self._file_id = fd, journal_id
        self._position = HEADER_SIZE
        self._preallocated = preallocate

    def _accepting(self) -> _Group:
        """The group taking appends; the writer is woken by its first record."""
        group = self._group
        if group is None or self._closing or self._failed is not None:
            raise JournalFailed(f"journal is not accepting appends: {self._failed or 'closed'}")
        if not group.parts:
            group.first_at = self._clock.monotonic()
            self._wake_writer()
        return group

    def _wake_writer(self) -> None:
        """Records to write (called with the lock held): wake the writer, wherever it
        waits (the loop's coroutine, or the thread waiting after a write)."""
        assert self._kick is not None
        self._kick.set()
        if self._writer_waits:
            self._more.notify()

    def append(
        self, ledger_id: int, entry_id: int, crc: int, payload: bytes
    ) -> asyncio.Future[LogMark]:
        header = RECORD_HEADER.pack(len(payload), ledger_id, entry_id, crc)
        with self._lock:
            group = self._group
            if group is None or not group.parts or self._closing or self._failed is not None:
                group = self._accepting()  # the checks, and the writer's wake-up
            group.parts += (header, payload)
            group.size += RECORD_HEADER.size + len(payload)
            group.records += 1
            self._appended(group)
            return group.future

    def append_batch(
        self, ledger_id: int, first_entry_id: int, crcs: list[int], payloads: list[bytes]
    ) -> asyncio.Future[LogMark]:
        """The batch goes into one group whole (it may pass the size threshold; the group
        is sealed after it), as batch records: one future, one write, one acknowledgment."""
        limit = self._settings.max_entry_size
        parts, size = encode_batch(ledger_id, first_entry_id, crcs, payloads, limit)
        with self._lock:
            group = self._accepting()
            group.parts += parts
            group.size += size
            group.records += len(payloads)
            self._appended(group)
            return group.future

    def _appended(self, group: _Group) -> None:
        """After an append (lock held): seal the group once full, or wake a writer waiting
        for this many records."""
        if group.size >= self._group_threshold:
            self._seal()
        elif self._writer_waits and group.records >= self._wanted:
            self._more.notify()

    def _seal(self) -> _Group:
        """Close the group taking appends: it is written next, the next one fills (with
        the lock held)."""
        group = self._taking()
        self._sealed.append(group)
        self._group = _Group(asyncio.get_running_loop())
        self._wake_writer()
        return group

    def sync_point(self) -> asyncio.Future[LogMark]:
        """Seal the group taking appends, so that its mark falls exactly after every record
        appended so far and before any later one (a checkpoint swaps its cache here)."""
        with self._lock:
            if self._group is not None and self._group.parts:
                return self._seal().future
            if self._sealed:
                return self._sealed[-1].future
            if self._writing is not None:
                return self._writing
        done: asyncio.Future[LogMark] = asyncio.get_running_loop().create_future()
        if self._failed is not None:
            done.set_exception(JournalFailed(f"journal write failed: {self._failed}"))
        else:
            done.set_result(self._durable)
        return done

    def checkpoint_point(self) -> asyncio.Future[LogMark]:
        """The journal never makes appends wait for space: the same as ``sync_point``."""
        return self.sync_point()

    async def _write_loop(self) -> None:
        loop = asyncio.get_running_loop()
        kick = self._kick
        assert kick is not None
        max_wait = self._settings.journal_max_group_wait_ms / 1000
        eager = self._settings.journal_flush_when_queue_empty
        while True:
            current = self._taking()
            if not current.parts and not self._sealed:
                if self._closing:
                    return
                await kick.wait()
                kick.clear()
                continue
            age = self._clock.monotonic() - current.first_at
            if not (self._sealed or self._closing or eager) and age < max_wait:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(kick.wait(), max_wait - age)
                kick.clear()
                continue  # sealed meanwhile, or now old enough: look again
            groups, self._sealed = self._sealed, []
            due = self._closing or eager or age >= max_wait
            if current.parts and (due or not groups):
                groups.append(current)
                self._group = _Group(loop)
            self._writing = groups[-1].future
            try:
                await loop.run_in_executor(self._executor, self._write_on, groups)
            except _WriteFailed as failed:
                groups, error = failed.groups, failed.error
                if isinstance(error, DiskFull):
                    self._refuse(groups, error)
                    continue
                self._fail(groups, error)
                return
            except BaseException as e:
                self._fail(groups, e)
                return
            finally:
                self._writing = None

    def _fail(self, groups: list[_Group], error: BaseException) -> None:
        self._failed = error
        log.error("journal write failed; the node stops acknowledging", exc_info=error)
        failure = JournalFailed(f"journal write failed: {error}")
        for pending in [*groups, *self._sealed, self._taking()]:
            # A group may be acknowledged already: the writer thread goes on with the next
            # groups on its own, so a cancelled wait for it can hold done groups.
            if not pending.future.done():
                pending.future.set_exception(failure)
                pending.future.exception()  # retrieved here; awaiting appends still get it

    def _acknowledge(self, groups: list[_Group], marks: list[LogMark]) -> None:
        self._durable = marks[-1]
        for done, mark in zip(groups, marks, strict=True):
            done.future.set_result(mark)

    def _write_on(self, groups: list[_Group]) -> None:
        """Blocking: write ``groups`` and acknowledge them through the loop (in order: the
        loop runs these callbacks first in, first out). With journal_flush_when_queue_empty,
        then write what comes next (``_wait_for_next``), and so on, without going back to
        the event loop: the disk never waits for the loop to get round to starting the next
        write. A failing write raises with ``groups`` set to its own groups."""
        loop = self._loop
        assert loop is not None
        eager = self._settings.journal_flush_when_queue_empty
        while True:
            try:
                marks = self._write_groups(groups)
            except BaseException as e:
                raise _WriteFailed(groups, e) from e
            loop.call_soon_threadsafe(self._acknowledge, groups, marks)
            if not eager:
                return
            with self._lock:
                groups = self._wait_for_next(loop, groups)
                if not groups:
                    return
                self._writing = groups[-1].future

    def _wait_for_next(
        self, loop: asyncio.AbstractEventLoop, written: list[_Group]
    ) -> list[_Group]:
        """The groups to write next, waited for (lock held): after a small write of
        ``written`` (under half the group threshold), as many records as it carried, for at
        most as long as its fdatasync took (and journal_max_group_wait_ms); with none queued
        at all, the first record, for up to ``IDLE_PARK_S``: a lone add then wakes this
        thread itself, where handing back to the loop made it wait for a turn of the loop
        and the executor's hand-off (0.1-0.4 ms of a tailing stream's append, measured on
        two busy cores). At once when a group is sealed (full, or a checkpoint's
        ``sync_point``). Empty when none came, or once closing.

        The adds just acknowledged come back with their successors (clients with one add
        outstanding each): waiting for them, one write takes them all, where the first few
        would start a write that the rest then wait behind, the clients splitting into
        cohorts that take turns at the disk, each paying a whole fdatasync (Redis's one
        fsync per pass of its event loop avoids the same). After a large write the sync
        was shared widely already, and the loop is what limits: then the next write takes
        what is queued at once, and the loop works while the disk writes. Waiting here
        rather than back on the loop matters too: the loop, busy with the adds just
        acknowledged, would start the next write only after all of them, a full window of
        adds then moving in lock-step with the disk."""
        max_wait_s = self._settings.journal_max_group_wait_ms / 1000
        small = sum(group.size for group in written) < self._group_threshold // 2
        peers_s = min(max_wait_s, self._last_sync_s) if small else 0.0
        records = sum(group.records for group in written)
        began = time.monotonic()
        while not self._closing and not self._sealed:
            queued = self._taking().records
            limit = peers_s if queued else IDLE_PARK_S
            waited = time.monotonic() - began
            if queued >= records or waited >= limit:
                break
            self._wanted = records
            self._writer_waits = True
            self._more.wait(limit - waited)
            self._writer_waits = False
        return self._take_queued(loop)

    def _take_queued(self, loop: asyncio.AbstractEventLoop) -> list[_Group]:
        """The groups waiting to be written, the one taking appends included (lock held)."""
        queued, self._sealed = self._sealed, []
        current = self._group
        if current is not None and current.parts:
            queued.append(current)
            self._group = _Group(loop)
        return queued

    def _refuse(self, groups: list[_Group], error: DiskFull) -> None:
        """A write found no space, and nothing of it is in the file. Its groups fail, and so
        does every group queued behind them: groups complete in order (a batch spread over
        several groups is acknowledged by its last one), so none may become durable ahead
        of a failed one. The storage turns read-only first, so that the adds woken here
        and the clients after them get a 507 at once."""
        pending = [*groups, *self._sealed]
        self._sealed = []
        taking = self._taking()
        if taking.parts:
            pending.append(taking)
            self._group = _Group(asyncio.get_running_loop())
        log.error("%s: %d group write(s) refused", error.message, len(pending))
        if self._on_no_space is not None:
            self._on_no_space(error.message)
        for group in pending:
            group.future.set_exception(DiskFull(error.message))
            group.future.exception()  # retrieved here; awaiting appends still get it

    def _taking(self) -> _Group:
        """The group taking appends (set from start() on)."""
        assert self._group is not None
        return self._group

    def _write_groups(self, groups: list[_Group]) -> list[LogMark]:
        """Blocking: one pwrite (group start record, the groups, padding), one fdatasync,
        maybe a rotation. Returns each group's mark: the offset just after its records."""
        records = sum(group.records for group in groups)
        start = encode_group_start(self._position)
        parts = [start]
        end = self._position + len(start)
        marks = []
        for group in groups:
            parts.extend(group.parts)
            end += group.size
            marks.append(LogMark(self._file_id, end))
        tail = padding(end - self._position, self._settings.journal_alignment_size)
        parts.append(tail)
        data = b"".join(parts)
        end += len(tail)
        if end > self._preallocated:
            # Space first: with the blocks allocated, the pwrite below has nothing left to
            # run out of (ext4 even reserves room for converting preallocated extents),
            # so a full disk fails here, before a byte of the write is in the file.
            step = self._settings.journal_pre_alloc_size
            wanted = (end // step + 1) * step
            try:
                os.posix_fallocate(self._fd, 0, wanted)
            except OSError as e:
                if is_no_space(e):
                    raise self._no_space(e) from e
                raise
            self._preallocated = wanted
        began = time.perf_counter()
        self._pwrite_all(data)
        wrote = time.perf_counter()
        if self._settings.journal_sync_data:
            self._fdatasync(self._fd)
            self._last_sync_s = time.perf_counter() - wrote
        self._probe.journal_write(records, len(data), wrote - began, time.perf_counter() - wrote)
        self._position = end
        self.groups_written += 1
        self.bytes_written += len(data)
        marks[-1] = LogMark(self._file_id, end)
        if end >= self._settings.journal_max_size:
            self._rotate()
        return marks

    def _pwrite_all(self, data: bytes) -> None:
        """Write ``data`` at the write position, or fail leaving none of it in the file.

        A write that fails half-way (the fallocate before makes it unlikely for want of
        space, not impossible: a file system that emulates fallocate, a quota; or a disk
        error after a short write) has the part that landed zeroed and synced before the
        groups fail. Left there, it would hold the failed write's group start record,
        tagged with this very offset, and its records: replay (after a crash, or the
        restart that a fatal error needs) would return entries whose adds were refused,
        the first records of a refused batch among them, and once a shorter write lands
        here its padding ends before them, where a record of the failed write may sit
        whole, right after the valid data. Zeros are "end of data" to replay. Overwriting
        blocks just written needs no new space; if it fails anyway, or the sync does, the
        journal fails for good (the caller's fatal path), as for any failed fdatasync."""
        view = memoryview(data)
        written = 0
        try:
            while written < len(data):
                written += _pwrite_some(
                    self._fd, view[written:], self._position + written, self._pwrite
                )
        except OSError as e:
            if written:
                zeros = memoryview(bytes(written))
                cleared = 0
                while cleared < written:
                    cleared += _pwrite_some(self._fd, zeros[cleared:], self._position + cleared)
                os.fdatasync(self._fd)
            if is_no_space(e):
                raise self._no_space(e) from e
            raise

    def _no_space(self, error: OSError) -> DiskFull:
        self._drop_backups()
        path = journal_path(self._dir, self._file_id)
        return DiskFull(f"no space left for the journal at {path}: {error.strerror or error}")

    def _rotate(self) -> None:
        self._faults.hit("journal.rotate.before")
        old_fd = self._fd
        os.ftruncate(old_fd, self._position)  # give back the preallocated tail
        os.fsync(old_fd)
        self._preallocated = self._position
        try:
            self._open_file(self._file_id + 1)
        except OSError as e:
            if not (is_no_space(e) or is_out_of_resources(e)):
                raise
            # The groups just written are durable; only the rotation waits. journal_max_size
            # is a soft limit: the current file takes the next writes (each extension of it
            # may fail with DiskFull) and the rotation is tried again after each of them, so
            # it happens as soon as space or a descriptor (EMFILE) is free again.
            if not self._rotation_deferred:  # (once, not at every write that retries)
                log.warning(
                    "cannot start the next journal (%s); %s grows past journal_max_size "
                    "meanwhile, the rotation is retried after every write",
                    e.strerror or e,
                    journal_path(self._dir, self._file_id),
                )
            self._rotation_deferred = True
            return
        os.close(old_fd)
        if self._rotation_deferred:
            log.info("started journal %x, after a deferred rotation", self._file_id)
            self._rotation_deferred = False
        self._faults.hit("journal.rotate.after")

    def checkpoint_complete(self, mark: LogMark) -> None:
        """Persist ``mark`` as lastMark, then delete journals wholly before it beyond
        ``journal_max_backups`` (BookKeeper keeps the newest ones for forensics)."""
        self._settings.ledgers_dir.mkdir(parents=True, exist_ok=True)
        self._faults.hit("checkpoint.mark")
        write_file_atomically(self._settings.ledgers_dir / LAST_MARK_FILE, LAST_MARK.pack(*mark))
        older = [i for i in list_journals(self._dir) if i < mark.log_id]
        for journal_id in older[: max(0, len(older) - self._settings.journal_max_backups)]:
            journal_path(self._dir, journal_id).unlink(missing_ok=True)

    def _drop_backups(self) -> None:
        """Journals wholly before the last mark serve forensics only: on a full disk their
        space is worth more (the next writes, a checkpoint, the index)."""
        mark = self.last_mark()
        for journal_id in list_journals(self._dir):
            if journal_id < mark.log_id:
                journal_path(self._dir, journal_id).unlink(missing_ok=True)
                log.warning("deleted journal backup %x for want of space", journal_id)

    async def close(self) -> None:
        if self._writer is None:
            return
        with self._lock:
            self._closing = True
            self._wake_writer()
        await self._writer
        self._writer = None
        await asyncio.get_running_loop().run_in_executor(self._executor, self._close_file)
        self._executor.shutdown(wait=False)  # idle: its last job was awaited

    def _close_file(self) -> None:
        if self._fd >= 0:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1

    @property
    def queued_bytes(self) -> int:
        return self._group.size if self._group else 0

    @property
    def failure(self) -> str | None:
        return failure_of(self._failed)
