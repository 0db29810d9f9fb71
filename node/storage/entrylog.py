"""Entry logs (BookKeeper's DefaultEntryLogger): large append-only files where the entries
of many ledgers are interleaved, written in sorted batches at checkpoints. Their bytes are
``logformat``'s; this module writes, seals, scans and reads them.

A log is never appended to after a restart: the writer always starts a new one, so a log
that has no map (a crash before its roll) is simply scanned. ``lastId`` holds the last
allocated log id in hex.

What such a scan learns is kept beside the log, so that the next start does not read the log
again (BookKeeper can keep it in a RocksDB, ``gcEntryLogMetadataCacheEnabled``). The log
itself is never patched: where its records end cannot be told from a cut record. The map
file is written atomically and deleted with its log.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import operator
import os
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import accumulate, repeat
from pathlib import Path

from node.settings import Settings
from node.storage.errors import CorruptRecord
from node.storage.faults import Faults, Pwrite, Pwritev
from node.storage.fsutil import fsync_dir, write_file_atomically
from node.storage.logformat import (
    HEADER_SIZE,
    MAP_FIELDS,
    MAP_FIELDS_OFFSET,
    MAP_FILE_SUFFIX,
    RECORD_HEADER,
    RECORD_OVERHEAD,
    SIZE_FIELD,
    SUFFIX,
    decode_header,
    decode_map_file,
    decode_map_records,
    decode_record_header,
    encode_header,
    encode_ledgers_map,
    encode_map_file,
    log_path,
    map_file_path,
    split_location,
)
from node.storage.wal import record_crc

log = logging.getLogger(__name__)

_BODY_BEFORE_PAYLOAD = RECORD_OVERHEAD - SIZE_FIELD  # the size field counts these and the payload
_crc = operator.itemgetter(0)  # of a write cache's (crc, payload)
_payload = operator.itemgetter(1)
IOV_MAX = os.sysconf("SC_IOV_MAX")  # buffers one pwritev takes (1024 on Linux)
LAST_ID_FILE = "lastId"
COMPACTING_SUFFIX = ".compacting"  # a compaction output being written: <id>.log.compacting
READ_AHEAD_STEP = 256 * 1024  # read-ahead reads the log in steps of this size


# A checkpoint's entries of one ledger: (ledger id, entry ids in order, entries by id as
# (crc, payload)); the write cache hands them so, and the entry log and index take them so.
LedgerEntries = tuple[int, list[int], dict[int, tuple[int, bytes]]]


def delete_log(directory: Path, log_id: int) -> None:
    """The log, then the map kept beside it (a crash in between leaves a map that
    ``delete_orphan_map_files`` finds)."""
    path = log_path(directory, log_id)
    path.unlink(missing_ok=True)
    map_file_path(path).unlink(missing_ok=True)


def delete_orphan_map_files(directory: Path) -> None:
    """Delete the map files whose log is gone, and any a crash left half written (only GC
    writes them, and it calls this first). Best effort: an orphan costs a few bytes."""
    orphans = list(directory.glob(f"*{SUFFIX}{MAP_FILE_SUFFIX}.tmp"))
    for path in directory.glob(f"*{SUFFIX}{MAP_FILE_SUFFIX}"):
        if not path.with_suffix("").exists():
            orphans.append(path)
    for path in orphans:
        try:
            path.unlink(missing_ok=True)
        except OSError as e:
            log.warning("could not delete %s: %s", path, e)


def list_logs(directory: Path) -> list[int]:
    ids = []
    for path in directory.glob(f"*{SUFFIX}"):
        with contextlib.suppress(ValueError):
            ids.append(int(path.stem, 16))
    return sorted(ids)


@dataclass(frozen=True, slots=True)
class ScannedRecord:
    offset: int
    ledger_id: int
    entry_id: int
    payload: bytes
    crc_ok: bool
    crc: int = 0  # as stored


def scan(path: Path) -> Iterator[ScannedRecord]:
    """Every record of a log in file order, ledgers-map records included, with its CRC
    verdict. Stops at the end of data (zeros, EOF or a record that cannot fit)."""
    with open(path, "rb") as f:
        header = f.read(HEADER_SIZE)
        try:
            decode_header(header)
        except (ValueError, struct.error) as e:
            raise CorruptRecord(str(path), 0, f"bad entry log header: {e}") from None
        size = os.fstat(f.fileno()).st_size
        offset = HEADER_SIZE
        while offset + RECORD_OVERHEAD <= size:
            head = f.read(RECORD_OVERHEAD)
            length, ledger_id, entry_id, crc = decode_record_header(head)
            if length < 0 or offset + RECORD_OVERHEAD + length > size:
                return
            payload = f.read(length)
            ok = record_crc(ledger_id, entry_id, payload) == crc
            if not ok and length == 0 and ledger_id == 0 and entry_id == 0:
                return  # zeros: end of data
            yield ScannedRecord(offset, ledger_id, entry_id, payload, ok, crc)
            offset += RECORD_OVERHEAD + length


def read_ledgers_map(path: Path) -> dict[int, int] | None:
    """The ledgers map a sealed log carries, or None (an unsealed log, or a map that does
    not check out: the caller scans instead)."""
    with open(path, "rb") as f:
        try:
            _version, map_offset, map_count = decode_header(f.read(HEADER_SIZE))
        except (ValueError, struct.error):
            return None
        if map_offset == 0 or map_count == 0:
            return None
        f.seek(map_offset)
        return decode_map_records(f.read(), map_count)


def read_map_file(path: Path, log_size: int) -> dict[int, int] | None:
    """The map kept beside the log at ``path``, if it holds for ``log_size``."""
    try:
        return decode_map_file(map_file_path(path).read_bytes(), log_size)
    except FileNotFoundError:
        return None


def known_ledgers_map(path: Path) -> dict[int, int] | None:
    """The log's ledgers map, or the one kept beside it; None where only a scan can tell."""
    mapped = read_ledgers_map(path)
    return mapped if mapped is not None else read_map_file(path, path.stat().st_size)


def ledger_sizes(
    path: Path, on_read: Callable[[int, int], None] | None = None, keep: bool = False
) -> dict[int, int]:
    """Bytes of each ledger in a log: from its ledgers map or the one kept beside it, else
    by a scan (reporting the records and bytes it reads to ``on_read``, so a throttle can
    pace it), whose result ``keep`` writes beside the log for the next start. Records that
    fail their CRC count for nothing. Raises CorruptRecord for a log that is not one."""
    mapped = known_ledgers_map(path)
    if mapped is not None:
        return mapped
    log_size = path.stat().st_size  # a log is never appended to once it is scanned
    sizes: dict[int, int] = {}
    for record in scan(path):
        size = RECORD_OVERHEAD + len(record.payload)
        if on_read is not None:
            on_read(1, size)
        if record.crc_ok and record.ledger_id >= 0:
            sizes[record.ledger_id] = sizes.get(record.ledger_id, 0) + size
    if keep:
        try:
            write_file_atomically(map_file_path(path), encode_map_file(log_size, sizes))
        except OSError as e:  # a full disk: the next start scans the log again, no worse
            log.warning("could not keep the ledgers map of %s: %s", path, e)
    return sizes


@dataclass(slots=True)
class _OpenLog:
    log_id: int
    fd: int
    position: int
    ledger_sizes: dict[int, int] = field(default_factory=dict)
    # As of the last successful flush: where a failed checkpoint cuts the log back to.
    flushed: int = HEADER_SIZE
    flushed_sizes: dict[int, int] = field(default_factory=dict)


class LogIdAllocator:
    """Hands out entry log ids, never twice, to the checkpoint's writer and to compaction
    (two threads); ``lastId`` keeps the high-water mark across restarts."""

    def __init__(self, directory: Path) -> None:
        self._dir = directory
        self._lock = threading.Lock()
        self._last: int | None = None

    def allocate(self) -> int:
        with self._lock:
            if self._last is None:
                self._dir.mkdir(parents=True, exist_ok=True)
                self._last = max(self._read_last_id(), *all_log_ids(self._dir), 0)
            log_id = self._last + 1
            if log_id >= 1 << 31:
                raise OSError("entry log ids exhausted (31 bits)")
            write_file_atomically(self._dir / LAST_ID_FILE, f"{log_id:x}\n".encode())
            self._last = log_id
            return log_id

    def _read_last_id(self) -> int:
        try:
            return int((self._dir / LAST_ID_FILE).read_text().strip(), 16)
        except FileNotFoundError:
            return 0


def all_log_ids(directory: Path) -> list[int]:
    """Ids of logs and of compaction outputs still being written (``<id>.log.compacting``)."""
    ids = set(list_logs(directory))
    for path in directory.glob(f"*{SUFFIX}{COMPACTING_SUFFIX}"):
        with contextlib.suppress(ValueError):
            ids.add(int(path.name.split(".", 1)[0], 16))
    return sorted(ids)


def create_log(path: Path) -> int:
    """A new log file with its header, durable with its name; returns its descriptor."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        write_fully(fd, encode_header(), 0)
        os.fdatasync(fd)
        fsync_dir(path.parent)
    except BaseException:
        os.close(fd)
        # A log without its header (a full disk) would be reported unreadable by every GC.
        with contextlib.suppress(OSError):
            path.unlink()
        raise
    return fd


def write_fully(fd: int, data: bytes, offset: int, pwrite: Pwrite = os.pwrite) -> None:
    """pwrite all of ``data``: a full disk shows as a short write, then as ENOSPC."""
    view = memoryview(data)
    while view:
        written = pwrite(fd, view, offset)
        if written == 0:
            raise OSError(errno.EIO, f"pwrite of {len(view)} bytes at {offset} wrote nothing")
        view, offset = view[written:], offset + written


def write_parts(
    fd: int,
    parts: list[bytes],
    offset: int,
    pwritev: Pwritev = os.pwritev,
    pwrite: Pwrite = os.pwrite,
) -> None:
    """``write_fully`` of the parts joined, without joining them: pwritev, ``IOV_MAX``
    parts at a time (a checkpoint's headers and payloads go to the kernel as they are,
    instead of through one more copy of the whole chunk)."""
    for start in range(0, len(parts), IOV_MAX):
        batch = parts[start : start + IOV_MAX]
        size = sum(map(len, batch))
        written = pwritev(fd, batch, offset)
        if written < size:  # a full disk shows first as a short write
            write_fully(fd, b"".join(batch)[written:], offset + written, pwrite)
        offset += size


def seal(fd: int, position: int, ledger_sizes: dict[int, int]) -> int:
    """Append the ledgers map at ``position`` and patch the header; returns the new end.
    The fsync is the caller's."""
    ledgers_map = encode_ledgers_map(ledger_sizes)
    write_fully(fd, ledgers_map, position)  # a cut map must fail, not be pointed at
    write_fully(fd, MAP_FIELDS.pack(position, len(ledger_sizes)), MAP_FIELDS_OFFSET)
    return position + len(ledgers_map)


def _count_bytes(ledger_sizes: dict[int, int], ledger_id: int, added: int) -> None:
    """Count a ledger's bytes in a log's map: a ledger none of whose bytes are in the log
    stays out of its map (GC and the audit read the map as "this log holds the ledger")."""
    if added:
        ledger_sizes[ledger_id] = ledger_sizes.get(ledger_id, 0) + added


class EntryLogWriter:
    """Appends sorted batches to the current log and rolls it at ``log_size_limit``.
    Used by one thread at a time (the checkpoint, serialized by the ledger storage)."""

    def __init__(
        self, settings: Settings, allocator: LogIdAllocator, faults: Faults | None = None
    ) -> None:
        self._dir = settings.ledgers_dir
        self._limit = settings.log_size_limit
        self._allocator = allocator
        faults = faults or Faults.from_settings(settings)
        self._pwritev = faults.pwritev("entrylog.write")
        self._pwrite = faults.pwrite("entrylog.write")
        self._fdatasync = faults.sync("entrylog.fsync")
        self._fsync = faults.sync("entrylog.fsync", os.fsync)
        self._current: _OpenLog | None = None
        self._rotated: list[_OpenLog] = []

    @property
    def current_log_id(self) -> int | None:
        return self._current.log_id if self._current else None

    def _new_log(self) -> _OpenLog:
        log_id = self._allocator.allocate()
        return _OpenLog(log_id, create_log(log_path(self._dir, log_id)), HEADER_SIZE)

    def append(self, ledgers: list[LedgerEntries]) -> list[list[int]]:
        """Append each ledger's entries in the given order (``WriteCache.sorted_ledgers``);
        return their locations, a list per ledger. Data reaches the OS, not the disk: call
        flush() before indexing them."""
        if not ledgers:
            return []  # a checkpoint of metadata only: no empty log file
        found: list[list[int]] = []
        parts: list[bytes] = []
        log = self._current or self._start()
        start = log.position
        for ledger_id, entry_ids, entries in ledgers:
            records = list(map(entries.__getitem__, entry_ids))
            payloads = list(map(_payload, records))
            sizes = list(map(len, payloads))
            total = sum(sizes) + RECORD_OVERHEAD * len(sizes)
            if log.position + total > self._limit:
                locations, log, parts, start = self._append_rolling(
                    log, parts, start, ledger_id, entry_ids, records
                )
                found.append(locations)
                continue
            # The common case, with no roll inside the ledger: headers, interleaving and
            # locations built by C loops (map, slices, accumulate), not a Python step per
            # entry (the checkpoint holds the GIL meanwhile, which the adds wait for).
            headers = list(
                map(
                    RECORD_HEADER.pack,
                    map(_BODY_BEFORE_PAYLOAD.__add__, sizes),
                    repeat(ledger_id),
                    entry_ids,
                    map(_crc, records),
                )
            )
            pairs: list[bytes] = [b""] * (2 * len(headers))
            pairs[::2] = headers
            pairs[1::2] = payloads
            parts += pairs
            first = (log.log_id << 32) | log.position
            locations = list(accumulate(map(RECORD_OVERHEAD.__add__, sizes), initial=first))
            locations.pop()  # where the next record would go
            found.append(locations)
            _count_bytes(log.ledger_sizes, ledger_id, total)
            log.position += total
        self._write(log, parts, start)
        return found

    def _append_rolling(
        self,
        log: _OpenLog,
        parts: list[bytes],
        start: int,
        ledger_id: int,
        entry_ids: list[int],
        records: list[tuple[int, bytes]],
    ) -> tuple[list[int], _OpenLog, list[bytes], int]:
        """``append`` of one ledger that reaches the size limit: entry by entry, rolling
        the log where the next record would pass it. Returns the ledger's locations and
        the log, parts and start position that ``append`` goes on with."""
        locations: list[int] = []
        added = 0  # bytes of this ledger in the current log
        position = log.position
        in_log = log.log_id << 32
        for entry_id, (crc, payload) in zip(entry_ids, records, strict=True):
            length = RECORD_OVERHEAD + len(payload)
            if position + length > self._limit and position > HEADER_SIZE:
                _count_bytes(log.ledger_sizes, ledger_id, added)
                self._write(log, parts, start)
                log.position = position
                log = self._roll()
                parts, start, position, added = [], log.position, log.position, 0
                in_log = log.log_id << 32
            parts += (RECORD_HEADER.pack(length - SIZE_FIELD, ledger_id, entry_id, crc), payload)
            locations.append(in_log | position)
            added += length
            position += length
        _count_bytes(log.ledger_sizes, ledger_id, added)
        log.position = position
        return locations, log, parts, start

    def _start(self) -> _OpenLog:
        self._current = self._new_log()
        return self._current

    def _write(self, log: _OpenLog, parts: list[bytes], start: int) -> None:
        if not parts:
            return
        write_parts(log.fd, parts, start, self._pwritev, self._pwrite)

    def _roll(self) -> _OpenLog:
        """Close the current log with its ledgers map and start the next one."""
        self._seal_current()
        return self._start()

    def _seal_current(self) -> None:
        """Append the ledgers map and patch the header; the fsync comes with flush()."""
        log = self._current
        assert log is not None
        log.position = seal(log.fd, log.position, log.ledger_sizes)
        self._rotated.append(log)
        self._current = None

    def roll(self) -> None:
        """Seal the current log now (at shutdown, so that a clean log carries its map)."""
        if self._current is not None and self._current.position > HEADER_SIZE:
            self._seal_current()

    def flush(self) -> list[int]:
        """fsync the current and rotated logs; return the ids of logs now closed for good."""
        current = self._current
        if current is not None:
            self._fdatasync(current.fd)
            current.flushed = current.position
            current.flushed_sizes = dict(current.ledger_sizes)
        closed = []
        while self._rotated:  # one at a time: a failure keeps the rest for the next flush
            log = self._rotated[0]
            self._fsync(log.fd)
            os.close(log.fd)
            self._rotated.pop(0)
            closed.append(log.log_id)
        return closed

    def discard_unflushed(self) -> None:
        """After a failed checkpoint (a full disk), whose records nothing indexes: cut the
        current log back to its last flush, so that the retry appends where the durable
        data ends. Left in place, a partial record, or pages a failed fsync dropped (zeros
        on disk: fsyncgate), would sit between durable records, and a scan (GC, compaction)
        stops at the first such gap, blind to live records after it. A log rolled by the
        failed checkpoint keeps its unindexed copies: dead bytes that compaction drops."""
        log = self._current
        if log is None:
            return
        os.ftruncate(log.fd, log.flushed)  # shrinking needs no space
        log.position = log.flushed
        log.ledger_sizes = dict(log.flushed_sizes)

    def close(self) -> None:
        self.flush()
        if self._current is not None:
            os.fsync(self._current.fd)
            os.close(self._current.fd)
            self._current = None


class LogRetired(Exception):
    """The log was chosen for deletion (compacted or emptied): look the entry up again."""


@dataclass(slots=True)
class _Handle:
    """An open log shared by readers (RocketMQ's ReferenceResource): ``holders`` count
    the reads using it; a retired handle takes no new holds and is closed, and its file
    deleted, when the last holder releases it."""

    fd: int
    holders: int = 0
    retired_at: float | None = None


class EntryLogReader:
    """Reads records by location through a bounded cache of open file handles.

    Thread safe: many reader threads share it, and GC retires logs from its own thread.
    """

    def __init__(self, settings: Settings, clock: Callable[[], float]) -> None:
        self._dir = settings.ledgers_dir
        self._max_open = settings.open_file_limit
        self._clock = clock
        self._lock = threading.Lock()
        self._handles: OrderedDict[int, _Handle] = OrderedDict()
        self._retired: dict[int, _Handle] = {}  # held when retired: deleted on release

    @contextlib.contextmanager
    def _open(self, log_id: int) -> Iterator[int]:
        with self._lock:
            if log_id in self._retired:
                raise LogRetired(log_id)
            handle = self._handles.get(log_id)
            if handle is None:
                try:
                    fd = os.open(log_path(self._dir, log_id), os.O_RDONLY)
                except FileNotFoundError:
                    raise LogRetired(log_id) from None
                handle = self._handles[log_id] = _Handle(fd)
                self._evict()
            else:
                self._handles.move_to_end(log_id)
            handle.holders += 1
        try:
            yield handle.fd
        finally:
            with self._lock:
                handle.holders -= 1
                if handle.holders == 0 and self._handles.get(log_id) is not handle:
                    self._finish(log_id, handle)

    def _finish(self, log_id: int, handle: _Handle) -> None:
        """Called with the lock held, for a handle out of the cache and no longer held."""
        if handle.fd >= 0:  # -1: already closed by a forced reap
            os.close(handle.fd)
        if self._retired.get(log_id) is handle:
            del self._retired[log_id]
            delete_log(self._dir, log_id)

    def _evict(self) -> None:
        while len(self._handles) > self._max_open:
            log_id, handle = next(iter(self._handles.items()))
            del self._handles[log_id]
            if handle.holders == 0:
                os.close(handle.fd)

    def retire(self, log_id: int) -> bool:
        """Delete a log as soon as no read holds it. Returns True if it is gone now, False
        if a reader holds it (then it goes on release, or by ``reap`` after the forced
        interval)."""
        with self._lock:
            handle = self._handles.pop(log_id, None)
            if handle is None or handle.holders == 0:
                if handle is not None:
                    os.close(handle.fd)
                delete_log(self._dir, log_id)
                return True
            handle.retired_at = self._clock()
            self._retired[log_id] = handle
            return False

    def reap(self, forcibly_after_s: float) -> list[int]:
        """Delete retired logs still held after ``forcibly_after_s`` (a leaked or stuck
        holder must not pin disk space forever: RocketMQ's destroyMapedFileIntervalForcibly).
        The holder's next read fails its checks (ids and CRC) rather than returning
        anything wrong."""
        now = self._clock()
        forced = []
        with self._lock:
            for log_id, handle in list(self._retired.items()):
                assert handle.retired_at is not None
                if now - handle.retired_at >= forcibly_after_s:
                    del self._retired[log_id]
                    delete_log(self._dir, log_id)
                    os.close(handle.fd)
                    handle.fd = -1
                    forced.append(log_id)
        return forced

    @property
    def retired(self) -> list[int]:
        with self._lock:
            return sorted(self._retired)

    def read_run(
        self,
        loc: int,
        ledger_id: int,
        entry_id: int,
        max_entries: int,
        max_bytes: int,
        already_cached: Callable[[int, int], bool] | None = None,
    ) -> list[tuple[int, bytes]]:
        """The entry at ``loc`` (checked: CRC, ledger and entry id) followed by read-ahead:
        the next records of the same ledger with rising entry ids, up to ``max_entries``
        more, ``max_bytes``, the end of the file, or an entry ``already_cached`` says the
        read cache holds (what follows it most likely is there too: reading it again
        would only churn the cache). Read-ahead reads the file in steps of
        READ_AHEAD_STEP, so a run that stops early costs little. Raises CorruptRecord for
        a bad entry; read-ahead stops silently at the first record it cannot trust."""
        log_id, offset = split_location(loc)
        path = log_path(self._dir, log_id)
        with self._open(log_id) as fd:
            head = os.pread(fd, RECORD_OVERHEAD, offset)
            if len(head) < RECORD_OVERHEAD:
                raise CorruptRecord(str(path), offset, "record header past the end of the log")
            length, lid, eid, crc = decode_record_header(head)
            if (lid, eid) != (ledger_id, entry_id):
                raise CorruptRecord(
                    str(path), offset, f"holds ({lid}, {eid}), not ({ledger_id}, {entry_id})"
                )
            ahead = min(max_bytes, READ_AHEAD_STEP) if max_entries > 0 else 0
            data = os.pread(fd, RECORD_OVERHEAD + length + ahead, offset)
            if len(data) < RECORD_OVERHEAD + length or length < 0:
                raise CorruptRecord(str(path), offset, f"record of {length} bytes is cut short")
            payload = data[RECORD_OVERHEAD : RECORD_OVERHEAD + length]
            if record_crc(ledger_id, entry_id, payload) != crc:
                raise CorruptRecord(str(path), offset, "CRC32C mismatch")
            run = [(entry_id, payload)]
            base, pos, last = offset, RECORD_OVERHEAD + length, entry_id
            budget = max_bytes
            while len(run) <= max_entries and budget > 0:
                if pos + RECORD_OVERHEAD > len(data):
                    data, base, pos = self._next_step(fd, data, base, pos, RECORD_OVERHEAD)
                    if pos + RECORD_OVERHEAD > len(data):
                        break  # the end of the file
                length, lid, eid, crc = decode_record_header(data, pos)
                if lid != ledger_id or eid <= last or length < 0:
                    break
                if already_cached is not None and already_cached(lid, eid):
                    break
                end = pos + RECORD_OVERHEAD + length
                if end > len(data):
                    data, base, pos = self._next_step(fd, data, base, pos, end - pos)
                    end = pos + RECORD_OVERHEAD + length
                    if end > len(data):
                        break
                payload = data[pos + RECORD_OVERHEAD : end]
                if record_crc(lid, eid, payload) != crc:
                    break
                run.append((eid, payload))
                budget -= end - pos
                last, pos = eid, end
        return run

    @staticmethod
    def _next_step(fd: int, data: bytes, base: int, pos: int, need: int) -> tuple[bytes, int, int]:
        """Read on: keep ``data[pos:]`` (file offset ``base + pos``) and append at least
        enough for ``need`` bytes from ``pos``, in steps of READ_AHEAD_STEP."""
        rest = data[pos:]
        more = os.pread(fd, max(READ_AHEAD_STEP, need - len(rest)), base + len(data))
        return rest + more, base + pos, 0

    def close(self) -> None:
        with self._lock:
            for handle in self._handles.values():
                os.close(handle.fd)
            self._handles.clear()
