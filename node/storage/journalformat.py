"""The file journal's bytes (journal.py writes them, replays them and ``inspect journal``
reads them): the file header, the records, the record parser and its judgment of an invalid
record, the files' names and ``lastMark``.

Journal file ``<id in hex>.txn``::

    offset  size  field
    0       4     magic "BKLG"
    4       4     version (u32) = 3 (2: no instance id; 1: nor batch records; both replayed)
    8       16    instance id: the one the journal's owner gives (the node: its cookie's,
                  node/replication/cookie.py); zeros without. A start refuses a journal
                  of another instance (the ids on disk: node/storage/walid.py).
    24      488   zero padding                         (header: one 512-byte sector)
    512     ...   records, then zeros (preallocated space; a zero length is "end of data")

Record::

    0   4   len u32       payload length; 0xFFFFFF00 marks a padding record
    4   8   ledger id i64
    12  8   entry id i64  (negative: a metadata record, see wal.py)
    20  4   crc32c u32    over ledger id | entry id | payload (wal.record_crc)
    24  len payload

Batch record (version 2): entries at consecutive ids of one ledger, one record for a whole
batch of adds, so that replay checks one CRC and hands the storage one run. Entry id BATCH
(wal.py); its payload, at most ``max_entry_size`` bytes (a longer batch takes several)::

    0   8   first entry id i64
    8   4   count u32
    12  8n  per entry: length u32 | crc32c u32 (its wal.record_crc, as the entry log keeps it)
    ..  ..  the entries' payloads, back to back

The record's CRC covers all of it; the entries' own CRCs are not checked again at replay.

Group start record (opens every group write, always at a 512-byte boundary): a record with
ledger id 0, entry id -0x100 and as payload its own file offset (u64). Only a valid one,
tagged with the offset it sits at, proves that a later write reached the disk: that is how
replay tells corruption (a bad record with a later write after it) from a torn tail (a
crash in the middle of the last write, whose sectors may land in any order). Records are
read by ``RecordScan`` and that decision is ``judge_invalid``'s: replay and ``python -m node
inspect journal`` both go through them.

Padding record (closes every group write at a 512-byte boundary)::

    0   4   0xFFFFFF00
    4   4   pad len u32
    8   ... pad len zero bytes

``lastMark`` (16 bytes, in the ledgers dir): journal id u64 | offset u64.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import crc32c

from node.settings import Settings
from node.storage.errors import CorruptRecord
from node.storage.wal import (
    BATCH,
    BatchRecord,
    LogMark,
    record_crc,
)

MAGIC = b"BKLG"
VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
HEADER_SIZE = 512
HEADER = struct.Struct(">4sI")
INSTANCE_ID = struct.Struct("16s")  # after HEADER, from version 3
NO_INSTANCE = bytes(INSTANCE_ID.size)
RECORD_HEADER = struct.Struct(">IqqI")
IDS = slice(4, 20)  # the header's ledger id | entry id: the prefix record_crc covers
PADDING_MASK = 0xFFFFFF00
PADDING_HEADER = struct.Struct(">II")
GROUP_START_ENTRY_ID = -0x100
GROUP_START = struct.Struct(">Q")
BATCH_HEAD = struct.Struct(">qI")  # first entry id, count
BATCH_ITEM_SIZE = 8  # length u32 | crc32c u32
LAST_MARK = struct.Struct(">QQ")
LAST_MARK_FILE = "lastMark"
METADATA_SLACK = 64 * 1024  # metadata records (ledger properties) may exceed max_entry_size
SUFFIX = ".txn"

Buffer = bytes | mmap.mmap


def encode_header(instance_id: bytes = NO_INSTANCE) -> bytes:
    head = HEADER.pack(MAGIC, VERSION) + INSTANCE_ID.pack(instance_id)
    return head.ljust(HEADER_SIZE, b"\0")


def decode_header(data: bytes) -> int:
    """The header's version; raises ValueError for a header that is not a journal's."""
    magic, version = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ValueError(f"bad magic {magic!r}")
    if version not in READABLE_VERSIONS:
        raise ValueError(f"unsupported journal version {version}")
    return int(version)


def header_instance_id(data: bytes) -> bytes | None:
    """The instance id a valid header carries; None when it has none (zeros, or a version
    before 3). ValueError as decode_header."""
    if decode_header(data) < 3:
        return None
    (instance_id,) = INSTANCE_ID.unpack_from(data, HEADER.size)
    return None if instance_id == NO_INSTANCE else bytes(instance_id)


def encode_record(ledger_id: int, entry_id: int, crc: int, payload: bytes) -> bytes:
    return RECORD_HEADER.pack(len(payload), ledger_id, entry_id, crc) + payload


def decode_record(buf: bytes | mmap.mmap, pos: int) -> tuple[int, int, int, int]:
    """(len, ledger id, entry id, crc) of the record header at ``pos``."""
    length, ledger_id, entry_id, crc = RECORD_HEADER.unpack_from(buf, pos)
    return length, ledger_id, entry_id, crc


def encode_batch(
    ledger_id: int, first_entry_id: int, crcs: list[int], payloads: list[bytes], limit: int
) -> tuple[list[bytes], int]:
    """The records of a batch's entries, as parts to write (not joined) and their size:
    batch records of at most ``limit`` payload bytes (``max_entry_size``), and a plain record
    for an entry that shares none."""
    count = len(payloads)
    lengths = list(map(len, payloads))
    if count > 1 and BATCH_HEAD.size + BATCH_ITEM_SIZE * count + sum(lengths) <= limit:
        return _encode_batch_record(ledger_id, first_entry_id, crcs, payloads, lengths)
    parts: list[bytes] = []
    size = 0
    start = 0
    while start < count:  # a batch too long for one record: as many entries as fit in each
        room = limit - BATCH_HEAD.size
        stop = start
        while stop < count and BATCH_ITEM_SIZE + lengths[stop] <= room:
            room -= BATCH_ITEM_SIZE + lengths[stop]
            stop += 1
        if stop - start > 1:
            more, more_size = _encode_batch_record(
                ledger_id, first_entry_id + start, crcs[start:stop], payloads[start:stop],
                lengths[start:stop],
            )  # fmt: skip
        else:
            stop, length = start + 1, lengths[start]
            header = RECORD_HEADER.pack(length, ledger_id, first_entry_id + start, crcs[start])
            more, more_size = [header, payloads[start]], RECORD_HEADER.size + length
        parts += more
        size += more_size
        start = stop
    return parts, size


def _encode_batch_record(
    ledger_id: int, first_entry_id: int, crcs: list[int], payloads: list[bytes], lengths: list[int]
) -> tuple[list[bytes], int]:
    count = len(payloads)
    items = itertools.chain.from_iterable(zip(lengths, crcs, strict=True))
    head = struct.pack(f">qI{2 * count}I", first_entry_id, count, *items)
    crc = record_crc(ledger_id, BATCH, head)
    for payload in payloads:
        crc = crc32c.crc32c(payload, crc)
    length = len(head) + sum(lengths)
    return [RECORD_HEADER.pack(length, ledger_id, BATCH, crc), head, *payloads], (
        RECORD_HEADER.size + length
    )


def decode_batch(buf: Buffer, start: int, end: int, ledger_id: int) -> BatchRecord | str:
    """The batch record payload ``buf[start:end]`` (its CRC checked), or what is wrong with
    it: a record that passed its CRC was written so, which is a bug, never a torn write."""
    if end - start < BATCH_HEAD.size:
        return "batch record shorter than its head"
    first_entry_id, count = BATCH_HEAD.unpack_from(buf, start)
    at = start + BATCH_HEAD.size + BATCH_ITEM_SIZE * count
    if at > end:
        return f"batch record of {count} entries shorter than its table"
    items = struct.unpack_from(f">{2 * count}I", buf, start + BATCH_HEAD.size)
    payloads = []
    for length in items[0::2]:
        payloads.append(buf[at : at + length])
        at += length
    if at != end:
        return f"batch record's entries end at {at}, the record at {end}"
    return BatchRecord(ledger_id, first_entry_id, list(items[1::2]), payloads)


def encode_group_start(offset: int) -> bytes:
    payload = GROUP_START.pack(offset)
    crc = record_crc(0, GROUP_START_ENTRY_ID, payload)
    return encode_record(0, GROUP_START_ENTRY_ID, crc, payload)


# --- the record parser -------------------------------------------------------------------
#
# Replay, ``inspect`` and the search for a later write all read records through RecordScan,
# and decide torn tail versus corruption through judge_invalid: one reading of the format.

# The entry id RecordScan gives a padding record (which has no ids in the file).
PADDING_ENTRY_ID = -PADDING_MASK

# (offset, end, ledger id, entry id, crc, payload) of a valid record
ScannedRecord = tuple[int, int, int, int, int, bytes]


class RecordScan:
    """The records of a journal from ``start``. Iterating yields each valid record as a
    ``ScannedRecord``: a padding record with entry id PADDING_ENTRY_ID, a batch record with
    an empty payload (``decode_batch`` reads it from the buffer: no copy of a whole batch).
    It stops at the end of data (zeros, or the end of the file) or at the first invalid
    record; ``end`` is then where the valid data ends, and ``invalid`` what is wrong
    there (None at the end of data). ``view``, a memoryview of ``buf``, lets a batch's CRC
    be checked without a copy; for an mmap the caller owns it (an mmap cannot close while
    a view of it lives)."""

    __slots__ = ("_buf", "_max_length", "_size", "_view", "end", "invalid")

    def __init__(
        self,
        buf: Buffer,
        start: int,
        size: int,
        max_length: int,
        view: memoryview | None = None,
    ) -> None:
        self._buf = buf
        self._view = view
        self._size = size
        self._max_length = max_length
        self.end = start
        self.invalid: str | None = None

    def __iter__(self) -> Iterator[ScannedRecord]:
        buf, view, size, max_length = self._buf, self._view, self._size, self._max_length
        unpack, head, crc_of = RECORD_HEADER.unpack_from, RECORD_HEADER.size, crc32c.crc32c
        ids_at, ids_end = IDS.start, IDS.stop
        pos = self.end
        while True:
            # The common case first, inline (replay runs at the speed of this loop): a
            # whole record whose CRC matches. Anything else (padding, the end of data,
            # which fails the CRC, or damage) is looked at after it.
            body = pos + head
            if body <= size:
                length, ledger_id, entry_id, crc = unpack(buf, pos)
                end = body + length
                if length <= max_length and end <= size:
                    ids_crc = crc_of(buf[pos + ids_at : pos + ids_end])
                    if entry_id == BATCH:
                        payload = b""
                        checked = buf[body:end] if view is None else view[body:end]
                    else:
                        payload = checked = buf[body:end]
                    if crc_of(checked, ids_crc) == crc:
                        yield pos, end, ledger_id, entry_id, crc, payload
                        pos = end
                        continue
            if pos + PADDING_HEADER.size <= size:
                mask, pad = PADDING_HEADER.unpack_from(buf, pos)
                if mask == PADDING_MASK:
                    end = pos + PADDING_HEADER.size + pad
                    if end > size:
                        self.end, self.invalid = pos, "padding past the end of file"
                        return
                    yield pos, end, 0, PADDING_ENTRY_ID, 0, b""
                    pos = end
                    continue
            self.end, self.invalid = pos, self._why_not_a_record(pos)
            return

    def _why_not_a_record(self, pos: int) -> str | None:
        """What is wrong with the bytes at ``pos``, which are not a valid record (None:
        they are the end of data)."""
        buf, size = self._buf, self._size
        if pos + RECORD_HEADER.size > size:
            return None if not any(buf[pos:size]) else "truncated record header"
        length, ledger_id, entry_id, crc = decode_record(buf, pos)
        if length == 0 and ledger_id == 0 and entry_id == 0 and crc == 0:
            return None  # preallocated zeros
        if length > self._max_length or pos + RECORD_HEADER.size + length > size:
            return f"record length {length} is not plausible"
        return "CRC32C mismatch"


def record_at(buf: Buffer, pos: int, size: int, max_length: int) -> ScannedRecord | None:
    """The valid record at ``pos``, if there is one."""
    return next(iter(RecordScan(buf, pos, size, max_length)), None)


def find_later_write(
    buf: Buffer, pos: int, size: int, alignment: int, max_length: int
) -> int | None:
    """The offset of the first group write after ``pos`` that reached the disk, if any: a
    group start record that sits where it says it was written."""
    candidate = (pos // alignment + 1) * alignment
    while candidate + RECORD_HEADER.size <= size:
        found = record_at(buf, candidate, size, max_length)
        if (
            found is not None
            and found[3] == GROUP_START_ENTRY_ID
            and len(found[5]) == GROUP_START.size
            and GROUP_START.unpack(found[5])[0] == candidate
        ):
            return candidate
        candidate += alignment
    return None


class Invalid(NamedTuple):
    """An invalid record and what it means: ``torn`` (no later write, in the newest
    journal: the last write was cut by a crash, its sectors landing in any order, and
    nothing of it was acknowledged) or, if not, corruption."""

    offset: int
    reason: str
    later: int | None  # the first group write after it that reached the disk
    torn: bool


def judge_invalid(
    buf: Buffer,
    offset: int,
    reason: str,
    size: int,
    newest: bool,
    alignment: int,
    max_length: int,
) -> Invalid:
    """Torn tail or corruption, for the invalid record at ``offset`` (replay and
    ``inspect`` both decide through this)."""
    later = find_later_write(buf, offset, size, alignment, max_length)
    return Invalid(offset, reason, later, later is None and newest)


def max_record_length(settings: Settings) -> int:
    """The longest payload a valid record may have: an entry, or a ledger's metadata."""
    return settings.max_entry_size + METADATA_SLACK


def padding(length: int, alignment: int) -> bytes:
    """The padding record that brings ``length`` bytes up to the next ``alignment`` boundary."""
    remainder = length % alignment
    if remainder == 0:
        return b""
    pad = alignment - remainder
    if pad < PADDING_HEADER.size:
        pad += alignment
    return PADDING_HEADER.pack(PADDING_MASK, pad - PADDING_HEADER.size) + bytes(
        pad - PADDING_HEADER.size
    )


def journal_path(directory: Path, journal_id: int) -> Path:
    return directory / f"{journal_id:x}{SUFFIX}"


def list_journals(directory: Path) -> list[int]:
    ids = []
    for path in directory.glob(f"*{SUFFIX}"):
        with contextlib.suppress(ValueError):
            ids.append(int(path.stem, 16))
    return sorted(ids)


def read_last_mark(ledgers_dir: Path) -> LogMark:
    try:
        data = (ledgers_dir / LAST_MARK_FILE).read_bytes()
    except FileNotFoundError:
        return LogMark(0, 0)
    if len(data) != LAST_MARK.size:
        raise CorruptRecord(str(ledgers_dir / LAST_MARK_FILE), 0, f"{len(data)} bytes, not 16")
    return LogMark(*LAST_MARK.unpack(data))
