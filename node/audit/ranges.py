"""Reading one byte range of an entry log: the work of one Spark task (no pyspark here).

A range owns the records that *start* in it; the last one may end past it. The first range
of a log starts at the end of the header, where a record starts. Any other range starts
at an arbitrary byte, so it first finds the first record boundary at or after its start
(``resync``): an offset is a boundary when the record header there is plausible (a size
of at least the header, ids of an entry or of the ledgers map, a record that fits in the
file) and so is the chain of records that follows it, and at least one record of that
chain passes its CRC32C. A record with a bad CRC is thereby still found when it starts a
range (the records after it vouch for it), and a false boundary inside a payload would
need a run of plausible headers whose CRC32C checks out by chance. The range before it
walks record by record with the sizes, so both agree where one range's last record ends.

Rows are Arrow record batches: (node, log id, offset, ledger id, entry id, size of the
whole record, CRC ok, the CRC32C of the record as it is on disk: what the replicas check
compares across nodes). No payload byte leaves the function.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import pyarrow as pa

from node.storage import logformat
from node.storage.wal import record_crc

OVERHEAD = logformat.RECORD_OVERHEAD
SIZE_FIELD = logformat.SIZE_FIELD
MIN_SIZE_FIELD = OVERHEAD - SIZE_FIELD  # a record of an empty payload
READ_CHUNK = 8 * 1024 * 1024  # bytes per pread: few system calls, bounded memory
BATCH_ROWS = 65_536  # rows per Arrow batch handed to Spark
CHAIN_RECORDS = 4  # records of a candidate's chain looked at before deciding
DEFAULT_MAX_RECORD = 64 * 1024 * 1024  # a size field above this is not a record's

SCHEMA = pa.schema(
    [
        ("node", pa.string()),
        ("log_id", pa.int64()),
        ("offset", pa.int64()),
        ("ledger_id", pa.int64()),
        ("entry_id", pa.int64()),
        ("size", pa.int64()),
        ("crc_ok", pa.bool_()),
        ("crc", pa.int64()),
    ]
)
SPARK_SCHEMA = (
    "node string, log_id long, offset long, ledger_id long, entry_id long, size long, "
    "crc_ok boolean, crc long"
)


Columns = tuple[list[int], list[int], list[int], list[int], list[bool], list[int]]


def plan_ranges(size: int, split_bytes: int) -> list[tuple[int, int]]:
    """[start, end) ranges covering the records of a log of ``size`` bytes."""
    ranges = []
    start = logformat.HEADER_SIZE
    while start < size:
        end = min(start + split_bytes, size)
        ranges.append((start, end))
        start = end
    return ranges


class Preader(Protocol):
    """A log's bytes: a local file, or ranges over HTTP (node.audit.remote.HttpLog)."""

    size: int

    def pread(self, length: int, offset: int) -> bytes: ...


class _FileLog:
    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.size = os.fstat(fd).st_size

    def pread(self, length: int, offset: int) -> bytes:
        return os.pread(self.fd, length, offset)


class _Window:
    """A sliding buffer over the file, refilled by large preads."""

    def __init__(self, log: Preader) -> None:
        self.log = log
        self.file_size = log.size
        self.data = b""
        self.base = 0

    def get(self, offset: int, length: int) -> memoryview | None:
        """``length`` bytes at ``offset``, or None past the end of the file."""
        if offset + length > self.file_size:
            return None
        rel = offset - self.base
        if rel < 0 or rel + length > len(self.data):
            self.data = self.log.pread(max(READ_CHUNK, length), offset)
            self.base, rel = offset, 0
            if len(self.data) < length:
                return None
        return memoryview(self.data)[rel : rel + length]


def _plausible(head: memoryview, offset: int, file_size: int, max_record: int) -> int | None:
    """The record's total size if its header could be a record's, else None."""
    size, ledger_id, entry_id, _crc = logformat.RECORD_HEADER.unpack(head)
    if size < MIN_SIZE_FIELD or size > max_record or offset + SIZE_FIELD + size > file_size:
        return None
    is_map = (ledger_id, entry_id) == (
        logformat.LEDGERS_MAP_LEDGER_ID,
        logformat.LEDGERS_MAP_ENTRY_ID,
    )
    if not is_map and (ledger_id < 0 or entry_id < 0):
        return None
    return int(SIZE_FIELD + size)


def _crc_ok(window: _Window, offset: int, total: int) -> bool:
    record = window.get(offset, total)
    if record is None:
        return False
    _size, ledger_id, entry_id, crc = logformat.RECORD_HEADER.unpack(record[:OVERHEAD])
    return bool(record_crc(ledger_id, entry_id, record[OVERHEAD:]) == crc)


def _is_end(window: _Window, offset: int) -> bool:
    """The end of data: the end of the file, or a zero size field (the zeros after it)."""
    head = window.get(offset, SIZE_FIELD)
    return head is None or bytes(head) == bytes(SIZE_FIELD)


def _is_boundary(window: _Window, offset: int, max_record: int) -> bool:
    vouched = False
    position = offset
    for _ in range(CHAIN_RECORDS):
        head = window.get(position, OVERHEAD)
        if head is None:
            return vouched or position == window.file_size
        total = _plausible(head, position, window.file_size, max_record)
        if total is None:
            return vouched and _is_end(window, position)
        vouched = vouched or _crc_ok(window, position, total)
        position += total
        if _is_end(window, position):
            return vouched
    return vouched


def resync(window: _Window, start: int, end: int, max_record: int) -> int | None:
    """The first record boundary in [start, end), or None."""
    for offset in range(start, end):
        head = window.get(offset, OVERHEAD)
        if head is None:
            return None
        if _plausible(head, offset, window.file_size, max_record) is None:
            continue
        if _is_boundary(window, offset, max_record):
            return offset
    return None


def scan_range(
    path: Path,
    node: str,
    log_id: int,
    start: int,
    end: int,
    max_record: int = DEFAULT_MAX_RECORD,
) -> Iterator[pa.RecordBatch]:
    """The records starting in [start, end) of one log file, as Arrow batches."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return  # deleted since the plan (a live node's GC): nothing to read
    try:
        yield from scan_log(_FileLog(fd), node, log_id, start, end, max_record)
    finally:
        os.close(fd)


def scan_log(
    log: Preader,
    node: str,
    log_id: int,
    start: int,
    end: int,
    max_record: int = DEFAULT_MAX_RECORD,
) -> Iterator[pa.RecordBatch]:
    """The records starting in [start, end) of one log, as Arrow batches. Stops, as the
    engine's scan does, at the end of data (zeros, the end of the file, a record that
    cannot fit)."""
    window = _Window(log)
    offset: int | None = start
    if start != logformat.HEADER_SIZE:
        offset = resync(window, start, end, max_record)
    columns: Columns = ([], [], [], [], [], [])
    offsets, ledgers, entries, sizes, oks, crcs = columns
    unpack = logformat.RECORD_HEADER.unpack_from
    while offset is not None and offset < end:
        head = window.get(offset, OVERHEAD)
        if head is None:
            break
        size, ledger_id, entry_id, crc = unpack(head)
        total = SIZE_FIELD + size
        if size < MIN_SIZE_FIELD:
            break  # zeros (the end of data) or a size that is not a record's
        record = window.get(offset, total)
        if record is None:
            break  # a record cut by the end of the file
        actual = record_crc(ledger_id, entry_id, record[OVERHEAD:])
        ok = actual == crc
        crcs.append(actual)
        offsets.append(offset)
        ledgers.append(ledger_id)
        entries.append(entry_id)
        sizes.append(total)
        oks.append(ok)
        offset += total
        if len(offsets) >= BATCH_ROWS:
            yield _batch(node, log_id, columns)
            for column in columns:
                column.clear()
    if offsets:
        yield _batch(node, log_id, columns)


def _batch(node: str, log_id: int, columns: Columns) -> pa.RecordBatch:
    offsets, ledgers, entries, sizes, oks, crcs = columns
    rows = len(offsets)
    return pa.RecordBatch.from_arrays(
        [
            pa.array([node] * rows, pa.string()),
            pa.array([log_id] * rows, pa.int64()),
            pa.array(offsets, pa.int64()),
            pa.array(ledgers, pa.int64()),
            pa.array(entries, pa.int64()),
            pa.array(sizes, pa.int64()),
            pa.array(oks, pa.bool_()),
            pa.array(crcs, pa.int64()),
        ],
        schema=SCHEMA,
    )
